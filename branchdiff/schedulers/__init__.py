"""Sampling steps as pure functions with log-probs: the flow-matching SDEs and ODE (`flow`), the DDIM
η-step for ε-models (`ddim`), their one-step marginals (`marginals`) and a family's step schedule
(`schedule`).

May import: nothing of branchdiff (the bottom of the house).
"""
