"""Prompt data: prompt sources and the per-iteration draw (`prompts`), and the built-in task's
prompt grammar and renderer (`tiny_task`).

May import: errors only.
"""
