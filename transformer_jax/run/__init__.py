"""The modes a researcher runs, each in one place, on the layers below: `train` (--mode=train:
`train_and_evaluate`, set-up → data → the compiled steps → the loop → the final evaluation), `evaluate`
(--mode=evaluate and --mode=translate), `tune_decoding`, and the set-up they share: the config checked
(`config_checks`) and built into mesh, model, optimiser, vocabulary and checkpoint managers (`experiment`)."""
