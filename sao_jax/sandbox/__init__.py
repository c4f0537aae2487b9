"""Running model-written code in a sandbox (standard library only).

  runner.py        the library side: `run_python`, `isolation`
  init_program.py  the per-run init program (namespaces, limits), started by
                   its path
  isolation.py     what containment this machine supports
"""
