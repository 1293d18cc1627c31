"""The harness: everything the recipe needs to run on real machines, and what measures and teaches it. A reader of the
recipe (the nine files beside this package) may skip it and know what they skipped.

    flags         train.py's flags, their checks, the resume rules, args.json
    checkpoints   a run's checkpoint files: saving, loading, migrating
    runtime       the learner's run: process groups, the output-directory lock, signals, metrics, reporters
    packing       completions into rows and micro-batches
    head_gemm     the learner's FP32 LM head: log-probabilities in chunks, and its split-bf16 GEMM
    memory_plan   the learner's GPU memory per rank, and the layout, printed before start
    vllm_replica  what runs inside vLLM: interruptions, a replica's process, the handshake
    weight_transfer  the CPU engine of vLLM's weight-transfer API (gloo), registered in vLLM's factories
    wire          the replica channel: plain-data messages, the handshake's keys, authenticated frames
    vllm_internals   every use of vLLM outside its public API, checked against the installed vLLM
    tasks         the task: prompts, verifiers, data readers
    base_model    how the tiny base model is built, and a real one converted for the CPU tests
    cli           what every command line shares: one error line for a bad flag
    commands      train.py's other commands: export, evaluate, migrate-checkpoint, plan, --help-markdown
    bench         benchmarks that print ratios from one run
    experiments   studies made of real train.py runs: staleness, ablations, reports
    teach         exercises graded by the tests, pictures of the losses

Its entry points run as modules from the repository root: `python -m harness.base_model build-base`,
`python -m harness.tasks check-answer`, `python -m harness.bench ...`, `python -m harness.experiments ...`,
`python -m harness.teach ...`. It imports nothing here, so that importing one module costs that module only.
"""
