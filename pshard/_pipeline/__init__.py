"""Pipeline parallelism: a model cut into stages along a mesh axis, one stage per rank.

``schedule`` holds the schedules as data (a lock-step timeline every rank computes the same
way) and draws them; ``executor`` runs one rank's part of a schedule, its stages'
forwards and backwards (``stage_call``; zero bubble's backward cut in two over one autograd
graph: ``split_backward``) and its messages through ``transport``; ``split`` cuts the
microbatches, ``setup`` checks a call on every rank; ``value_and_grad`` and ``forward`` are
the public functions.
"""
