"""`deepspeed.runtime.base_optimizer.DeepSpeedOptimizer`: the marker class DeepSpeed's own optimizer wrappers
derive from, which Lightning's Fabric checks with isinstance when it saves a checkpoint. crew's engines hold
torch optimizers (torch.optim.Optimizer), so nothing is one; the class exists so that the import and the check
work as under DeepSpeed 0.19.8, where it is an empty class too."""


class DeepSpeedOptimizer:
    pass
