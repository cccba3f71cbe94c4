"""Side-by-side benchmarks: one iteration of each algorithm (`iteration`, also `bench explore`),
held-out accuracy against time (`curves`, with the modelled GPU clock `clock` and the statistics
`stats`), and inference-time search against best-of-N (`search`).

May import: training and every layer below it; only cli imports it.
"""
