"""What keeps a run safe, and the processes it runs on: files written whole or not at all (`storage`),
checkpoint folders closed by manifests (`checkpoint`), the run folder's lock (`run_dir`), heartbeats
(`watchdog`), metrics.jsonl (`metrics_log`), cross-process reductions (`distributed`), FSDP2
sharding (`sharding`), peak memory per phase (`memory`) and the second Ctrl-C's immediate exit (`abort`).

May import: errors only (the bottom of the house, with data and schedulers).
"""
