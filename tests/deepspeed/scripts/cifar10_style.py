# Written for crew's tests in the shape of DeepSpeedExamples training/cifar/cifar10_deepspeed.py (its
# imports, arguments, config dict, engine calls and loops), not copied from it. Changed only what cannot
# run offline or in a test's time: a synthetic dataset of CIFAR-10's shapes (3x32x32 floats in [-1, 1],
# 10 classes, every class in the test set) instead of torchvision's download, and small epoch/sample counts.
import argparse
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: F401


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--samples", default=512, type=int)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class SyntheticCifar(torch.utils.data.Dataset):
    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(count) % 10
        centers = torch.randn(10, 3, 32, 32, generator=generator)
        noise = torch.randn(count, 3, 32, 32, generator=generator)
        self.images = (centers[self.labels] + 0.5 * noise).tanh()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], int(self.labels[index])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def get_ds_config(args):
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 10}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


def test(model_engine, testset, local_device, target_dtype, test_batch_size=4):
    classes = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
    testloader = torch.utils.data.DataLoader(testset, batch_size=test_batch_size, shuffle=False, num_workers=0)
    correct, total = 0, 0
    class_correct, class_total = [0.0] * 10, [0.0] * 10
    model_engine.eval()
    with torch.no_grad():
        for images, labels in testloader:
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(predicted.device)).sum().item()
            c = (predicted == labels.to(predicted.device)).squeeze()
            for i in range(test_batch_size):
                class_correct[labels[i]] += c[i].item()
                class_total[labels[i]] += 1
    if model_engine.local_rank == 0:
        print(f"Accuracy of the network on the {total} test images: {100 * correct / total:.0f} %")
        for i in range(10):
            print(f"Accuracy of {classes[i]:5s} : {100 * class_correct[i] / class_total[i]:2.0f} %")


def main(args):
    deepspeed.init_distributed()
    _local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(_local_rank)
    if torch.distributed.get_rank() != 0:
        torch.distributed.barrier()  # rank 0 "downloads" first, as the original
    trainset = SyntheticCifar(args.samples, seed=1)
    if torch.distributed.get_rank() == 0:
        torch.distributed.barrier()
    testset = SyntheticCifar(40, seed=1)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=get_ds_config(args))
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / args.log_interval : .3f}")
                running_loss = 0.0
    print("Finished Training")
    test(model_engine, testset, local_device, target_dtype)
    if dist.get_rank() == 0:
        print("final steps", model_engine.global_steps)


if __name__ == "__main__":
    main(add_argument())
