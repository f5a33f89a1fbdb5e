"""`deepspeed.runtime.fp16`: only `loss_scaler`'s classes, which DeepSpeed (and crew, in DeepSpeed's layout)
pickles into checkpoint files: tools that torch.load those files with weights_only=False (Lightning's
convert_zero_checkpoint_to_fp32_state_dict) import them by name. crew's fp16 training is crew/runtime/precision.py."""
