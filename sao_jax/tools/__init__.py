"""Command-line tools: show a resolved config, plan TPU runs without TPUs.

show_config.py  `python -m sao_jax.tools.show_config`: a recipe after overrides
aot_compile.py  `python -m sao_jax.tools.aot_compile`: the train step compiled
                for a TPU topology, with its per-device memory
tpu_aot.py      libtpu's compile-only devices, for the compile above
"""
