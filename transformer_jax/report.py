"""`python -m transformer_jax.report DIR ...`, the documented command: runs `tools/report.py` as the program."""
import runpy

if __name__ == '__main__':
  runpy.run_module('transformer_jax.tools.report', run_name='__main__', alter_sys=True)
