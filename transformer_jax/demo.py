"""`python -m transformer_jax.demo ...`, the documented command: runs `tools/demo.py` as the program."""
import runpy

if __name__ == '__main__':
  runpy.run_module('transformer_jax.tools.demo', run_name='__main__', alter_sys=True)
