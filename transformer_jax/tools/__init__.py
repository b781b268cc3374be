"""Tools around a run: what --mode=compile, benchmark, export, summary and config run (`aot`, `tpu_slices`,
`benchmark`, `export`, `summary`, `config_doc`), the Table 3 report of a sweep (`report`, `findings`,
`significance`), reading a run for the notebook (`inspection`, `plots`) and a tiny demo run (`demo`)."""
