# The shape of Lightning's DeepSpeed docs: a LightningModule (configure_model builds the network, so that
# ZeRO-3 builds it under deepspeed.zero.Init; configure_optimizers returns an optimizer and a per-step
# scheduler), Trainer(strategy="deepspeed_stage_N" or DeepSpeedStrategy(config=...), devices=2). Each case
# fits one epoch (3 steps) and saves (trainer.save_checkpoint, or ModelCheckpoint), then a fresh Trainer
# resumes with fit(ckpt_path=...) for a second epoch; at stage 3 also trainer.test, after the fit and from the
# checkpoint. Then Fabric's DeepSpeed strategy (fabric_case). Rank 0 writes every rank's losses and lrs.
#
# Lightning refuses DeepSpeed on its CPU accelerator (DeepSpeedStrategy.setup_environment wants a
# CUDAAccelerator, under real DeepSpeed too), so the ranks run on a CUDAAccelerator that keeps them on the
# CPU: a test harness, the same under crew and under DeepSpeed (DS_ACCELERATOR=cpu, torchrun).
import argparse
import json
import os

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.accelerators import CUDAAccelerator as FabricCUDAAccelerator
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--cases", default="deepspeed_stage_1,deepspeed_stage_2,deepspeed_stage_3,config,fabric")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

SAMPLES, MICRO_BATCH, LR, CLIP = 24, 4, 0.05, 0.05  # 24 samples / (4 x 2 ranks): 3 steps an epoch


class CPUDevices:
    """The devices of a CUDA accelerator, on the CPU: the harness (Lightning refuses DeepSpeed on its CPU
    accelerator, under DeepSpeed too)."""

    def setup_device(self, device):
        pass

    def teardown(self):
        pass

    @staticmethod
    def parse_devices(devices):
        return list(range(devices))

    @staticmethod
    def get_parallel_devices(devices):
        return [torch.device("cpu", index) for index in devices]

    @staticmethod
    def is_available():
        return True


class CPUAsCUDA(CPUDevices, CUDAAccelerator):
    """Lightning's CUDA accelerator with its devices on the CPU (the harness)."""

    def setup(self, trainer):
        pass

    def get_device_stats(self, device):
        return {}


def data():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=generator)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = None

    def configure_model(self):
        if self.net is None:
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def test_dataloader(self):
        return DataLoader(data(), batch_size=MICRO_BATCH)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(data(), batch_size=MICRO_BATCH)


class Record(Callback):
    """This rank's loss and lr at each step."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
        self.steps.append({"step": trainer.global_step, "loss": outputs["loss"].item(), "lr": lr})


def strategy(case):
    if case != "config":
        return case
    # A DeepSpeed config file of the user's: ZeRO-2 with its bucket settings and a gradient clipping that bites.
    path = os.path.join(args.out, f"ds_config_{os.environ['RANK']}.json")  # one a rank: no race, no barrier
    config = {"zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                    "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7},
              "zero_allow_untested_optimizer": True, "gradient_clipping": CLIP}
    with open(path, "w") as file:
        json.dump(config, file)
    return DeepSpeedStrategy(config=path)


def trainer(case, epochs, callbacks):
    return pl.Trainer(accelerator=CPUAsCUDA(), devices=2, strategy=strategy(case), max_epochs=epochs,
                      callbacks=callbacks, logger=False, enable_progress_bar=False, use_distributed_sampler=True,
                      enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                      default_root_dir=args.out)


def run_case(case):
    folder = os.path.join(args.out, case)
    first, second = Record(), Record()
    by_callback = case in ("deepspeed_stage_2", "config")
    saver = [ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1)] if by_callback else []
    fit = trainer(case, 1, [first, *saver])
    fit.fit(Regressor())
    path = os.path.join(folder, "epoch=0.ckpt") if by_callback else os.path.join(folder, "saved.ckpt")
    if not by_callback:
        fit.save_checkpoint(path)
    resumed = trainer(case, 2, [second])
    model = Regressor()
    resumed.fit(model, ckpt_path=path)
    engine = resumed.strategy.deepspeed_engine
    result = {"steps": first.steps + second.steps, "global_step": resumed.global_step,
              "engine": type(engine).__name__, "saved": sorted(os.listdir(path)),
              "tag": sorted(os.listdir(os.path.join(path, "checkpoint")))}
    if case == "deepspeed_stage_3":
        result.update(evaluate(path, resumed, model))
    return result


def evaluate(path, fitted, model):
    """ZeRO-3 evaluation (a second, inference engine): of the module the fit trained, with the fit's Trainer,
    and of a fresh module loaded from the checkpoint."""
    tested = pl.Trainer(accelerator=CPUAsCUDA(), devices=2, strategy="deepspeed_stage_3", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.out)
    return {"test_after_fit": attempt(lambda: fitted.test(model, verbose=False)[0]["test_loss"]),
            "test_from_checkpoint": attempt(
                lambda: tested.test(Regressor(), ckpt_path=path, verbose=False)[0]["test_loss"])}


def attempt(call):
    """The call's value, or its error as text (the same script runs under DeepSpeed, which fails elsewhere)."""
    try:
        return call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"


class FabricCPUAsCUDA(CPUDevices, FabricCUDAAccelerator):
    """The same harness for Fabric (its own accelerator classes)."""


def fabric_case():
    """Fabric's DeepSpeed strategy (ZeRO-2), in the shape of its docs: setup, backward, step; three steps,
    fabric.save, a fresh setup loads the checkpoint and runs three more (the second epoch)."""
    fabric = Fabric(accelerator=FabricCPUAsCUDA(), devices=2, strategy="deepspeed_stage_2")
    fabric.launch()
    path, steps = os.path.join(args.out, "fabric.ckpt"), []

    def setup():
        module = Regressor()
        module.configure_model()
        optimizer = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
        return fabric.setup(module.net, optimizer)

    def train(model, optimizer, epoch):
        sampler = DistributedSampler(data(), num_replicas=2, rank=fabric.global_rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data(), batch_size=MICRO_BATCH, sampler=sampler):
            loss = F.mse_loss(model(x), y)
            fabric.backward(loss, model=model)  # two setups in this process: Fabric asks which
            optimizer.step()
            optimizer.zero_grad()
            steps.append({"step": len(steps) + 1, "loss": loss.item(), "lr": LR})

    model, optimizer = setup()
    train(model, optimizer, 0)
    fabric.save(path, {"model": model, "optimizer": optimizer, "epoch": 0})
    model, optimizer = setup()
    state = {"model": model, "optimizer": optimizer, "epoch": None}
    fabric.load(path, state)
    train(model, optimizer, state["epoch"] + 1)
    engine = fabric.strategy.model
    return {"steps": steps, "global_step": engine.global_steps, "engine": type(engine).__name__,
            "saved": sorted(os.listdir(path)), "tag": sorted(os.listdir(os.path.join(path, "checkpoint")))}


results = {case: fabric_case() if case == "fabric" else run_case(case) for case in args.cases.split(",")}
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, results)
if dist.get_rank() == 0:
    with open(os.path.join(args.out, "lightning.json"), "w") as file:
        json.dump(everyone, file, indent=1)
