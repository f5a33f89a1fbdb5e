"""The launcher side of a running job: supervising the agents, hang reports, the job record, timings."""
