"""The harness: everything the recipe needs to run on real machines. A reader of the recipe (the nine files beside this
package) may skip it and know what they skipped. It lies beneath the recipe: no module here imports train.py,
pipeline_rl.py or scaling_fit.py (tests/test_layout.py checks it), and nothing here imports the tools above both
(tools/: the benchmarks, the experiments, the teaching kit).

    flags         train.py's flags, their checks, the resume rules, args.json
    checkpoints   a run's checkpoint files: saving, loading, migrating
    runtime       the learner's run: process groups, the output-directory lock, signals, metrics, reporters
    packing       completions into rows and micro-batches
    head_gemm     the learner's FP32 LM head: log-probabilities in chunks, and its split-bf16 GEMM
    memory_plan   the learner's GPU memory per rank, and the layout, printed before start
    vllm_replica  what runs inside vLLM: interruptions, a replica's process, the handshake
    fleet         the generator's replicas: their settings, processes and connections, the weight push to them
    weight_transfer  the CPU engine of vLLM's weight-transfer API (gloo), registered in vLLM's factories
    wire          the replica channel: plain-data messages, the handshake's keys, authenticated frames
    vllm_internals   every use of vLLM outside its public API, checked against the installed vLLM
    tasks         the task: prompts, verifiers, data readers
    base_model    how the tiny base model is built, and a real one converted for the CPU tests
    cli           what every command line shares: one error line for a bad flag
    commands      train.py's other commands: export, evaluate, migrate-checkpoint, plan, --help-markdown

Its entry points run as modules from the repository root: `python -m harness.base_model build-base`,
`python -m harness.tasks check-answer`. It imports nothing here, so that importing one module costs that module only.
"""
