"""The launching half of crew: hostfile -> plan -> runner -> one agent per node -> ranks.

Nothing here imports torch: only the ranks do.
"""
