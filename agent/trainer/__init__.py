"""coord's exact-resume trainer, run as ``python -m agent.train [mlx_lm lora options]``.

mlx-lm resumes weights only: after a crash its optimizer starts cold, the LR
schedule restarts and the data order repeats. This trainer is built from
mlx-lm's pieces (model loading, LoRA/DoRA/full set-up, datasets, schedules) and
saves everything a resume needs in each checkpoint, so a resumed run reproduces
the uninterrupted one step for step.

Modules:

- ``safetensors_file``: a small stdlib safetensors writer and header reader, atomic writes.
- ``state``: the trainer-state JSON kept in a checkpoint's metadata, and its checks.
- ``data``: which examples each optimizer step consumes, and the micro-batches of one rank.
- ``checkpoint``: host copies of arrays, background saves and fingerprints, restoring.
- ``progress``: stdout lines and ``$COORD_PROGRESS_FILE`` records.
- ``loop``: the compiled step, evaluation, the training loop.
- ``main``: options, model and optimizer set-up, resume, and the run.

Only this package imports mlx, mlx_lm and numpy; the rest of ``agent`` does not.
"""
