"""Beyond one process, on ``torch.distributed``.

parallel.py   TensorParallel: which slice of each weight a rank holds, and the timed
              collectives (all-reduce, the logits' gather, object broadcast) on a process group
launch.py     the process group: N ranks started here (torch.multiprocessing), or by torchrun
"""
