"""`deepspeed.launcher`: only the constants of `deepspeed.launcher.runner`; the launcher itself is `crew run`."""
