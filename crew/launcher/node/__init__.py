"""The node side of a job: the agent that starts, watches and stops its node's ranks."""
