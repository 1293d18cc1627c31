"""The tools that run the recipe and read its runs: they stand on top of both the recipe (the nine files at the root)
and the harness, and nothing beneath imports them back (tests/test_layout.py checks it).

    bench         benchmarks that print ratios from one run
    experiments   studies made of real train.py runs: staleness, ablations, reports
    teach         exercises graded by the tests, pictures of the losses

Each runs as a module from the repository root: `python -m tools.bench ...`, `python -m tools.experiments ...`,
`python -m tools.teach ...`. It imports nothing here, so that importing one tool costs that tool only.
"""
