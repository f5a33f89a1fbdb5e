"""The training half: what runs inside each rank after `crew.initialize` (DeepSpeed's `deepspeed.runtime`).

It imports nothing from crew.launcher: the only contract between the halves is the environment a
rank starts with (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...).
"""
