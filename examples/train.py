"""A DeepSpeed training script, unchanged but for its first import: `import crew as deepspeed`.

    crew run --num_gpus 2 examples/train.py --deepspeed --deepspeed_config examples/ds_config.json

A small regression model on synthetic data, in the shape of DeepSpeed's tutorial: argparse with
--local_rank and deepspeed.add_config_arguments, initialize(...) with training_data, then the
forward / backward / step loop. It also runs under torchrun, under DeepSpeed's own launcher, and
as a plain `python examples/train.py --deepspeed_config ...` (one process).
"""

import argparse
import json

import torch

import crew as deepspeed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="crew example: regression on synthetic data")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4096, help="size of the synthetic dataset")
    parser.add_argument("--fail_at_step", type=int, default=-1, help="raise at this step (demo)")
    parser.add_argument("--result", help="write the final loss and step count here (JSON)")
    parser.add_argument("--save_dir", help="save a checkpoint here after each epoch (engine.save_checkpoint)")
    return deepspeed.add_config_arguments(parser).parse_args()


def synthetic_dataset(samples: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)  # the same data on every rank
    inputs = torch.randn(samples, 32, generator=generator)
    true_weights = torch.randn(32, 1, generator=generator)
    targets = inputs @ true_weights + 0.01 * torch.randn(samples, 1, generator=generator)
    return torch.utils.data.TensorDataset(inputs, targets)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(),
        training_data=synthetic_dataset(args.samples))
    dtype = next(engine.module.parameters()).dtype
    for epoch in range(args.epochs):
        for inputs, targets in loader:
            if engine.global_steps == args.fail_at_step:
                raise RuntimeError(f"failing on purpose at step {engine.global_steps}")
            outputs = engine(inputs.to(engine.device, dtype))
            loss = torch.nn.functional.mse_loss(outputs.float(), targets.to(engine.device))
            engine.backward(loss)
            engine.step()
        if args.save_dir:
            engine.save_checkpoint(args.save_dir, client_state={"epoch": epoch})
    if args.result and engine.global_rank == 0:
        with open(args.result, "w") as out:
            json.dump({"loss": loss.item(), "steps": engine.global_steps,
                       "world_size": engine.world_size}, out)


if __name__ == "__main__":
    main()
