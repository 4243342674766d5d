"""Pipeline parallelism: a model cut into stages along a mesh axis, one stage per rank.

``schedule`` holds the schedules as data (a lock-step timeline every rank computes the same
way), ``executor`` runs one rank's part of it with each stage's ``torch.func.vjp``,
``value_and_grad`` and ``forward`` are the public functions.
"""
