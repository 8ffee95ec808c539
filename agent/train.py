"""``python -m agent.train [mlx_lm lora options]``: coord's exact-resume trainer.

mlx_lm lora's options, plus ``--fingerprint-every N``; every checkpoint holds
the optimizer state, LR schedule position, RNG key and data position, so
``--resume-adapter-file`` continues exactly where the run stopped. See
``agent/trainer/`` for how.
"""

from agent.trainer.main import main

if __name__ == "__main__":
    main()
