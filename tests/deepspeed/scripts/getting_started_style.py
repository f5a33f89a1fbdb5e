# Written for crew's tests in the shape of DeepSpeed's getting-started tutorial
# (docs/_tutorials/getting-started.md): args with --deepspeed_config, initialize(args=, model=,
# model_parameters=), the forward/backward/step loop, save_checkpoint with client_state and
# load_checkpoint returning it. Not copied from it. Changed: a synthetic regression data set instead of
# the tutorial's unspecified one; the tutorial's `client_sd=` keyword (a TypeError in DeepSpeed itself)
# is DeepSpeed's real `client_state=`, and its undefined `dataloader_to_step` is a skip in the loop.
import argparse
import json
import os

import deepspeed
import torch


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--save_dir", default="ckpt")
    parser.add_argument("--load_dir", default=None)
    parser.add_argument("--ckpt_id", default=None)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save_interval", type=int, default=20)
    deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    inputs = torch.randn(4096, 32)
    data = torch.utils.data.TensorDataset(inputs, inputs[:, :8].sum(dim=1, keepdim=True))
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model_engine, optimizer, loader, _ = deepspeed.initialize(args=args, model=model,
                                                              model_parameters=model.parameters(),
                                                              training_data=data)
    step = 0
    if args.load_dir is not None:
        _, client_sd = model_engine.load_checkpoint(args.load_dir, args.ckpt_id)
        step = client_sd["step"]
    losses = []
    for index, (x, y) in enumerate(loader):
        if index < step:  # advance the data to the checkpoint's step, as the tutorial says to
            continue
        loss = torch.nn.functional.mse_loss(model_engine(x), y)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
        step = index + 1
        if step % args.save_interval == 0:
            model_engine.save_checkpoint(args.save_dir, f"step{step}", client_state={"step": step})
        if step == args.steps:
            break
    with open(f"losses{os.environ['RANK']}.json", "w") as out:
        json.dump(losses, out)


if __name__ == "__main__":
    main()
