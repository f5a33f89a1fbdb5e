"""The plain-torch baseline the step benchmarks compare crew with: DDP with its defaults,
clip_grad_norm_, AdamW (no weight decay), zero_grad(set_to_none=True); and their step-time table."""

import statistics

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


def step_time_table(runs: dict[str, list[list[float]]], failures: dict[str, str]) -> dict[str, float]:
    """One row per mode: the median step time over all its runs, each run's median, the ratio to
    the "ddp" mode. runs: {mode: [step times of one run, ...]}. Returns {mode: median seconds}."""
    print(f"{'mode':<11} | {'median ms':>9} | {'run medians ms':>20} | {'vs DDP':>6}")
    print("-" * 11 + "-+-" + "-" * 9 + "-+-" + "-" * 20 + "-+-" + "-" * 6)
    medians = {}
    for mode, mode_runs in runs.items():
        if not mode_runs:
            print(f"{mode:<11} | {failures.get(mode, 'no run')}")
            continue
        medians[mode] = statistics.median(t for run in mode_runs for t in run)
        per_run = ", ".join(f"{statistics.median(run) * 1e3:.0f}" for run in mode_runs)
        ratio = medians[mode] / medians["ddp"] if "ddp" in medians else float("nan")
        print(f"{mode:<11} | {medians[mode] * 1e3:9.1f} | {per_run:>20} | {ratio:6.3f}")
    return medians
