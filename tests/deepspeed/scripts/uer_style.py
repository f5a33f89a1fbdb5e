"""UER-py's shape under `--deepspeed` (dbiir/UER-py: uer/trainer.py, models/deepspeed_config.json).

UER builds its own optimizer (an AdamW with `correct_bias`, an "untested" optimizer to ZeRO) and scheduler, and
passes both to deepspeed.initialize while the config also has an `optimizer` section; DeepSpeed 0.19.8 uses the
client's, and the client's scheduler over the config's. It calls init_distributed(dist_backend=args.backend)
first, then initialize(..., mpu=None, dist_init_required=False), and trains with model.backward / model.step.

Run by crew for each ZeRO stage in --stages (one engine after another); rank 0 saves losses, gradient norms,
learning rates and the final weights to results.pt. `reference()` is the same training in one process with
plain torch (clipping by the float64 norm, as DeepSpeed), for the test to compare.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

VOCAB, HIDDEN, SEQ, GLOBAL_BATCH, STEPS, LR = 500, 16, 8, 4, 6, 0.05


class AdamW(torch.optim.Optimizer):
    """UER's kind of AdamW: bias correction optional, decoupled weight decay."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "correct_bias": correct_bias})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
                state["step"] += 1
                state["exp_avg"].mul_(beta1).add_(param.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                step_size = group["lr"]
                if group["correct_bias"]:
                    step_size *= math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"])
                param.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(group["eps"]), value=-step_size)
                param.add_(param, alpha=-group["lr"] * group["weight_decay"])


class Mlm(torch.nn.Module):
    """A masked-LM head on a tied embedding, as UER's BERT target."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(VOCAB, HIDDEN)
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        self.layer_norm = torch.nn.LayerNorm(HIDDEN)
        self.output = torch.nn.Linear(HIDDEN, VOCAB)
        self.output.weight = self.embedding.weight

    def forward(self, src, tgt):
        hidden = self.layer_norm(torch.tanh(self.linear(self.embedding(src))))
        return torch.nn.functional.cross_entropy(self.output(hidden).view(-1, VOCAB), tgt.view(-1))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=generator),
            torch.randint(VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=generator))


def init_optimizer(model: torch.nn.Module):
    """As UER's init_optimizer: two groups (no decay for biases and norms), a linear warmup-decay schedule."""
    named = list(model.named_parameters())
    no_decay = ("bias", "layer_norm")
    groups = [{"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
              {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]
    optimizer = AdamW(groups, lr=LR, correct_bias=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / 2, (STEPS - s) / STEPS))
    return groups, optimizer, scheduler


def config(stage: int) -> dict:
    """UER's models/deepspeed_config.json in fp32 (its optimizer section, zero_allow_untested_optimizer, the
    legacy cpu_offload key, which DeepSpeed honours), with a scheduler section too: the client's scheduler must
    win over both."""
    zero = {"stage": stage, "contiguous_gradients": False, "overlap_comm": False, "reduce_scatter": False,
            "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7}
    extra = {}
    if stage == 2:  # DeepSpeed 0.19.8 offloads with a client optimizer only when not forced to its CPU Adam
        zero["cpu_offload"], extra["zero_force_ds_cpu_optimizer"] = True, False
    return {"gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2,
            "steps_per_print": 100, "gradient_clipping": 1.0,
            "optimizer": {"type": "Adam", "params": {"lr": 0.00001, "weight_decay": 1e-2}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.5, "warmup_num_steps": 1}},
            "zero_optimization": zero, "zero_allow_untested_optimizer": True, **extra}


def reference() -> dict:
    model = Mlm()
    _, optimizer, scheduler = init_optimizer(model)
    src, tgt = data()
    seen = {"losses": [], "norms": [], "lrs": []}
    for step in range(STEPS):
        seen["lrs"].append(optimizer.param_groups[0]["lr"])
        loss = model(src[step], tgt[step])
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.stack([g.double().norm() for g in grads]).square().sum().sqrt()
        for grad in grads:
            grad.mul_(float((1.0 / (norm + 1e-6)).clamp(max=1.0)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        seen["losses"].append(loss.item())
        seen["norms"].append(norm.item())
    seen["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
    return seen


def train(args, stage: int) -> dict:
    import deepspeed

    args.deepspeed_config = f"ds_zero{stage}_rank{deepspeed.comm.get_rank()}.json"  # no rank reads a half-written one
    with open(args.deepspeed_config, "w") as file:
        json.dump(config(stage), file)
    model = Mlm()
    groups, custom_optimizer, custom_scheduler = init_optimizer(model)
    model, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=groups, args=args, optimizer=custom_optimizer, lr_scheduler=custom_scheduler,
        mpu=None, dist_init_required=False)
    assert type(model).__name__ == "DeepSpeedEngine" and scheduler is custom_scheduler
    rank, half = deepspeed.comm.get_rank(), GLOBAL_BATCH // 2
    src, tgt = data()
    seen = {"losses": [], "norms": [], "lrs": []}
    for step in range(STEPS):
        seen["lrs"].append(model.get_lr()[0])
        rows = slice(rank * half, (rank + 1) * half)
        loss = model(src[step, rows], tgt[step, rows])
        model.backward(loss)
        model.step()
        mean = loss.detach().clone()
        deepspeed.comm.all_reduce(mean)
        seen["losses"].append(mean.item() / 2)
        seen["norms"].append(model.get_global_grad_norm().item())
    with deepspeed.zero.GatheredParameters(list(model.module.parameters())):  # whole at ZeRO-3 too
        seen["weights"] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    model.destroy()
    return seen


def main() -> None:
    import deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--stages", default="2,3")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    results = {stage: train(args, stage) for stage in map(int, args.stages.split(","))}
    if deepspeed.comm.get_rank() == 0:
        torch.save(results, "results.pt")


if __name__ == "__main__":
    main()
