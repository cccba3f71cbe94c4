"""Side-by-side benchmarks: one iteration of each algorithm (`iteration`, also `bench explore`),
held-out accuracy against time (`curves`, with the modelled GPU clock `clock` and the statistics
`stats`), inference-time search against best-of-N (`search`), and searches as samplers of the
reward-tilted target on Gaussian-mixture flows with exact targets (`sampler`, `gmm`); `tables` holds
the tables and files they write.

May import: training and every layer below it; only cli imports it.
"""
