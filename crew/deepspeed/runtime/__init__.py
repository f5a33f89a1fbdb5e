"""`deepspeed.runtime`: what scripts import from it (`deepspeed.runtime.utils`)."""
