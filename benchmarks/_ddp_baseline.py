"""The plain-torch baseline the step benchmarks compare crew with: DDP with its defaults,
clip_grad_norm_, AdamW (no weight decay), zero_grad(set_to_none=True)."""

import torch


def ddp_stepper(model: torch.nn.Module, lr: float, clip: float):
    """(step(inputs, targets), the DDP model, its optimizer); the process group must exist."""
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=0.0)

    def step(inputs, targets):
        torch.nn.functional.mse_loss(ddp(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step, ddp, optimizer
