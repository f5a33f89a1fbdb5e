"""How the launcher reaches the nodes: runners (local, ssh, pdsh, standalone, srun), the agent protocol,
process-tree helpers, and copying code to the nodes (crew sync)."""
