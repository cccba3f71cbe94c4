"""What a run shows: sample grids and the plotting primitives (`figures`), and the self-contained
HTML run report (`run_report`) with its data (`run_data`) and HTML pieces (`html`).

May import: objectives (their metrics' kinds), explore, settings, search, rewards, core, models,
schedulers, runtime, data, errors.
"""
