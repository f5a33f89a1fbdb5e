"""The Accelerate script that benchmarks/hf_compare.py runs, unchanged, under `accelerate launch` with real
DeepSpeed and under `crew run --as_deepspeed --config_file`.

A training loop in the shape of Accelerate's DeepSpeed guide: the launch YAML says DEEPSPEED and names a
DeepSpeed JSON whose optimizer and scheduler are in the config ("auto" values), so the script hands
Accelerate a DummyOptim and a DummyScheduler; `accelerator.prepare`, `accelerator.accumulate` (Accelerate
adopts the JSON's gradient_accumulation_steps), `accelerator.backward`, `clip_grad_norm_` on the boundary
(with DeepSpeed it returns the engine's grad norm), `save_state` every `--save_steps` optimizer steps into
OUT/checkpoint-N, `load_state` + `skip_first_batches` to resume (the loader is in order: a shuffled one's
order after a resume depends on where the RNG stood when its epoch began), and the model saved with
`get_state_dict` + `save_pretrained`. The same tiny GPT-2 (without dropout) and tokens as
benchmarks/_hf_trainer.py, fp32.

    train.py OUT [--steps 12] [--save_steps 4] [--resume OUT/checkpoint-4] --record run.json

The main process writes `--record` in _hf_trainer.py's format: a log history (loss: the mean over the
step's micro batches and the processes; grad_norm; learning_rate after the step), the optimizer steps
done, the world size, and time.time() at the start, at the first batch and after each optimizer step.
"""

import argparse
import json
import time

STARTED = time.time()

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DummyOptim, DummyScheduler, set_seed  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

LEARNING_RATE, WARMUP_STEPS, MICRO_BATCH = 1e-3, 3, 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, default=None, help="unused: the stage is in the launch config")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save_steps", type=int, default=4)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--record", required=True)
    args = parser.parse_args()

    accelerator = Accelerator()
    set_seed(0)
    # no dropout: a resumed run's DataLoader iterator draws its seed from the global RNG after load_state
    # restored it, one draw later than the uninterrupted run's, so its dropout masks would differ
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    tokens = torch.randint(0, 100, (64, 16), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(tokens, batch_size=MICRO_BATCH, shuffle=False)
    optimizer = DummyOptim(model.parameters(), lr=LEARNING_RATE)
    scheduler = DummyScheduler(optimizer, total_num_steps=args.steps, warmup_num_steps=WARMUP_STEPS)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accumulation = accelerator.deepspeed_plugin.deepspeed_config["gradient_accumulation_steps"]

    step = 0
    if args.resume:
        accelerator.load_state(args.resume)
        step = int(args.resume.rstrip("/").rsplit("-", 1)[1])
    history, step_ends, first_batch, micro_losses = [], [], None, []
    epoch = step * accumulation // len(loader)
    while step < args.steps:
        skip = step * accumulation - epoch * len(loader)
        for batch in accelerator.skip_first_batches(loader, skip) if skip else loader:
            first_batch = first_batch or time.time()
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                micro_losses.append(loss.detach())
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            mean_loss = accelerator.gather(torch.stack(micro_losses).mean()).mean().item()
            micro_losses = []
            step_ends.append(time.time())
            history.append({"step": step, "loss": mean_loss, "learning_rate": scheduler.get_last_lr()[0],
                            "grad_norm": None if grad_norm is None else float(grad_norm)})
            if step % args.save_steps == 0:
                accelerator.save_state(f"{args.out}/checkpoint-{step}")
            if step == args.steps:
                break
        epoch += 1

    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).save_pretrained(f"{args.out}/final", is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save,
                                                    state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        with open(args.record, "w") as record:
            json.dump({"started": STARTED, "train_begin": first_batch, "step_ends": step_ends, "global_step": step,
                       "world_size": accelerator.num_processes, "log_history": history}, record)


if __name__ == "__main__":
    main()
