"""DeepSpeed-Chat step 1 (supervised fine-tuning), the real application's main.py, unchanged, under
`crew run --as_deepspeed` and (given --deepspeed_python) under DeepSpeed 0.19.8, on this machine's CPU.

    .venv/bin/python benchmarks/dschat_step1.py --dschat /path/to/DeepSpeed-Chat \
        [--deepspeed_python /path/to/venv-with-deepspeed/bin/python] [--stages 0,2,3] [--no_lora] \
        [--dtypes bf16,fp16] [--epochs 2] [--no_warmup] [--keep]

--dschat is a checkout of DeepSpeedExamples' applications/DeepSpeed-Chat (the script never fetches it;
tested with DeepSpeedExamples@45b4b715). It is copied to a scratch folder, because its local/jsonfile
dataset reads data/train.json and data/eval.json beside dschat/: the copy gets the tiny data there
(tests/hf/dschat_tiny.py: a tiny OPT model and tokenizer, prompt/chosen/rejected records) and `dschat` is
found through PYTHONPATH (the application's `pip install -e .` does the same). Each run:

    main.py --model_name_or_path OPT --data_path local/jsonfile --data_split 10,0,0 --dtype D --zero_stage S
        --per_device_train_batch_size 4 --per_device_eval_batch_size 1 --max_seq_len 64
        --gradient_accumulation_steps 2 --num_train_epochs E --learning_rate 1e-2 --dropout 0.0 --print_loss
        --deepspeed --output_dir OUT [--lora_dim 4 --only_optimize_lora --gradient_checkpointing
        --lora_learning_rate 1e-2]

crew: `crew run --as_deepspeed --num_gpus 2 main.py ...`. DeepSpeed: its own launcher,
`DS_ACCELERATOR=cpu deepspeed --num_gpus 2 main.py ...` (it passes --local_rank as main.py expects and
starts 2 CPU ranks over gloo; its first start builds C++ ops, so one unmeasured warm-up run comes first).

What the application needs on a CPU machine, found here:
- transformers 5 moved `no_init_weights` out of transformers.modeling_utils (to transformers.initialization),
  and dschat/utils/model/model_utils.py imports it from the old place: main.py stops at import under any
  engine. When the Python lacks the old name, the runs get a `sitecustomize` (COMPAT, on PYTHONPATH for
  both engines alike) that adds it back once transformers.modeling_utils is loaded; main.py stays unchanged.
- --dtype is fp16 or bf16 (default fp16). DeepSpeed 0.19.8 on a CPU without fp16 kernels stops in
  initialize ("Type fp16 is not supported on your device."); bf16 runs. Hence bf16 by default here.
- FusedAdam (the optimizer without --offload) exists on DeepSpeed's CPU accelerator (a C++ op it builds);
  crew's is torch's Adam.

Prints one table: ZeRO stage and configuration, engine, dtype, exit code, eval perplexity (and loss) before
and after training as main.py prints them, the eval loss of the model it saved (pytorch_model.bin loaded
with from_pretrained here, fp32), the pretrained model's own eval loss (fp32, here) and the wall time of
the run (launcher start to exit). A failed run's last error line is printed under the table.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "hf"))
from _jobs import run_job  # noqa: E402  (beside this script: on its sys.path)
from dschat_tiny import eval_loss, write_data, write_model  # noqa: E402

MAX_SEQ_LEN = 64
LORA = ["--lora_dim", "4", "--only_optimize_lora", "--gradient_checkpointing", "--lora_learning_rate", "1e-2"]
PPL = re.compile(r"ppl: (\S+), loss: (\S+)$")
ERROR = re.compile(r"(\w+(Error|Exception)\b.*)$")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}

# Loaded at interpreter start (PYTHONPATH): gives transformers.modeling_utils back the `no_init_weights`
# DeepSpeed-Chat imports from it, after that module is loaded; imports nothing until then.
COMPAT = '''\
import importlib.abc, importlib.util, sys


class _NoInitWeightsBack(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "transformers.modeling_utils":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            if not hasattr(module, "no_init_weights"):
                from transformers.initialization import no_init_weights
                module.no_init_weights = no_init_weights

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _NoInitWeightsBack())
'''


@dataclass
class Result:
    stage: int
    config: str
    engine: str
    dtype: str
    code: int
    wall: float
    evals: list[tuple[float, float]]  # (perplexity, loss) as main.py prints them, before training first
    saved_loss: float | None
    error: str


def needs_compat(python: str) -> bool:
    probe = subprocess.run([python, "-c", "from transformers.modeling_utils import no_init_weights"],
                           capture_output=True, text=True)
    return probe.returncode != 0


def prepare(dschat: Path, folder: Path, pythons: list[str]) -> tuple[Path, Path, dict]:
    """The application's copy with the data beside it, the tiny model, and the runs' environment."""
    if not (dschat / "training" / "step1_supervised_finetuning" / "main.py").is_file():
        sys.exit(f"--dschat {dschat}: no training/step1_supervised_finetuning/main.py there. Give the "
                 "applications/DeepSpeed-Chat folder of a DeepSpeedExamples checkout.")
    chat = folder / "DeepSpeed-Chat"
    shutil.copytree(dschat, chat, ignore=shutil.ignore_patterns(".git", "output*", "__pycache__"))
    write_data(chat / "data")
    model = write_model(folder / "opt-tiny")
    paths = [str(chat)]
    if any(needs_compat(python) for python in pythons):
        compat = folder / "compat"
        compat.mkdir()
        (compat / "sitecustomize.py").write_text(COMPAT)
        paths.insert(0, str(compat))
        print("transformers has no modeling_utils.no_init_weights (DeepSpeed-Chat imports it): the runs get "
              f"{compat}/sitecustomize.py, which adds it back")
    env = {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])}
    return chat, model, env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launchers(args: argparse.Namespace, env: dict) -> dict[str, tuple[list[str], dict]]:
    found = {"crew": ([sys.executable, "-m", "crew", "run", "--as_deepspeed", "--num_gpus", "2"], env)}
    if args.deepspeed_python:
        deepspeed = str(Path(args.deepspeed_python).parent / "deepspeed")
        found["deepspeed"] = ([deepspeed, "--num_gpus", "2"], {**env, "DS_ACCELERATOR": "cpu"})
    return found


def run(launcher: tuple[list[str], dict], chat: Path, model: Path, out: Path, stage: int, dtype: str,
        extra: list[str], epochs: int) -> tuple[int, float, str]:
    command, env = launcher
    if command[0].endswith("deepspeed"):  # its fixed default port 29500 may be taken on a shared machine
        command = [*command, "--master_port", str(free_port())]
    main = chat / "training" / "step1_supervised_finetuning" / "main.py"
    argv = ["--model_name_or_path", str(model), "--data_path", "local/jsonfile", "--data_split", "10,0,0",
            "--data_output_path", str(out) + "-data", "--per_device_train_batch_size", "4",
            "--per_device_eval_batch_size", "1", "--max_seq_len", str(MAX_SEQ_LEN), "--gradient_accumulation_steps",
            "2", "--num_train_epochs", str(epochs), "--learning_rate", "1e-2", "--dropout", "0.0", "--print_loss",
            "--dtype", dtype, "--zero_stage", str(stage), "--deepspeed", "--output_dir", str(out), *extra]
    started = time.monotonic()
    proc = run_job([*command, str(main), *argv], cwd=out.parent, env=env, timeout=900)
    wall = time.monotonic() - started
    output = proc.stdout + proc.stderr
    out.parent.joinpath(out.name + ".log").write_text(output)
    return proc.returncode, wall, output


def result_of(stage: int, config: str, engine: str, dtype: str, code: int, wall: float, output: str,
              out: Path, chat: Path, model: Path) -> Result:
    evals = [(float(m.group(1)), float(m.group(2))) for line in output.splitlines() if (m := PPL.search(line))]
    saved = None
    if code == 0 and (out / "pytorch_model.bin").is_file():
        saved = eval_loss(out, model, chat / "data", MAX_SEQ_LEN)
    errors = [m.group(1) for line in output.splitlines() if (m := ERROR.search(line))]
    return Result(stage, config, engine, dtype, code, wall, evals, saved, errors[-1] if errors and code else "")


def fmt(value: float | None, spec: str = ".6f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(results: list[Result], pretrained: float) -> None:
    print(f"\npretrained model's eval loss (fp32, computed here): {pretrained:.6f}\n")
    print("| ZeRO | config | engine | dtype | exit | eval ppl before | eval ppl after | eval loss before | "
          "eval loss after | saved model's eval loss (fp32) | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        before, after = (r.evals[0] if r.evals else (None, None)), (r.evals[-1] if len(r.evals) > 1 else (None, None))
        print(f"| {r.stage} | {r.config} | {r.engine} | {r.dtype} | {r.code} | {fmt(before[0], '.3f')} | "
              f"{fmt(after[0], '.3f')} | {fmt(before[1])} | {fmt(after[1])} | {fmt(r.saved_loss)} | {r.wall:.1f} |")
    for r in results:
        if r.code:
            print(f"- ZeRO {r.stage} {r.config}, {r.engine}, {r.dtype}: exit {r.code}: {r.error or 'see its log'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dschat", required=True, type=Path, help="applications/DeepSpeed-Chat of DeepSpeedExamples")
    parser.add_argument("--deepspeed_python", help="a Python with deepspeed 0.19.8 and the HF stack (optional)")
    parser.add_argument("--stages", default="0,2,3")
    parser.add_argument("--no_lora", action="store_true", help="leave out the LoRA run at stage 3")
    parser.add_argument("--dtypes", default="bf16", help="main.py's --dtype values to run: bf16, fp16")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--no_warmup", action="store_true", help="no unmeasured first run per engine")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, saved models)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="crew-dschat-"))
    pythons = [sys.executable] + ([args.deepspeed_python] if args.deepspeed_python else [])
    chat, model, env = prepare(args.dschat.resolve(), folder, pythons)
    engines = launchers(args, env)
    pretrained = eval_loss(model, model, chat / "data", MAX_SEQ_LEN)
    configs = [(stage, "full", []) for stage in map(int, args.stages.split(","))]
    if 3 in [stage for stage, *_ in configs] and not args.no_lora:
        configs.append((3, "lora+gc", LORA))
    if not args.no_warmup:
        for name, launcher in engines.items():
            run(launcher, chat, model, folder / f"warmup-{name}", 0, "bf16", [], 1)
    results = []
    for dtype in args.dtypes.split(","):
        for stage, config, extra in configs:
            for name, launcher in engines.items():  # interleaved, so that drift in the machine's load hits both
                out = folder / f"{name}-z{stage}-{config}-{dtype}"
                code, wall, output = run(launcher, chat, model, out, stage, dtype, extra, args.epochs)
                results.append(result_of(stage, config, name, dtype, code, wall, output, out, chat, model))
                print(f"ran ZeRO {stage} {config} {dtype} under {name}: exit {code} in {wall:.1f} s", flush=True)
    print_table(results, pretrained)
    if args.keep:
        print(f"\nlogs and saved models in {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
