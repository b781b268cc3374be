"""Transformer (base model), Table 3 row "base", WMT 2014 English-German.

  python -m transformer_jax.main --config=configs/base.py --workdir=runs/base

Paper (Vaswani et al., 2017): N=6, d_model=512, d_ff=2048, h=8, d_k=d_v=64, P_drop=0.1, eps_ls=0.1,
100k steps of ~25,000 source + 25,000 target tokens, 65M parameters; newstest2013 PPL 4.92, BLEU 25.8;
newstest2014 BLEU 27.3 (Table 2). 12 hours on 8 P100 GPUs (0.4 s/step).

The paper's batch (~25,000 source + 25,000 target tokens, §5.1) on Cloud TPU slices, compiled by the TPU
compiler on a 2-core CPU without a TPU, shared with a training run (`--mode=compile --config.compile.topology=<slice>`,
bfloat16 compute, the default; benchmarks/tpu_fit_table.py); the step at the longest bucket, [97, 256] per side
padded to a multiple of the data shards. Step times are the roofline ESTIMATE of aot.roofline (model FLOPs at
the bf16 peak, XLA's bytes accessed at the HBM bandwidth; no collectives), not measurements:

  slice   chips  mesh     grad_accum_steps  GiB per chip / HBM  est. step, MFU  est. 100k steps  compile
  v4-8    4      data=4   1                 3.16 / 32           39 ms, 24%      1.1 h            5.7 min
  v5e-8   8      data=8   1                 2.31 / 16           35 ms, 20%      1.0 h            3.6 min
  v5p-8   4      data=4   1                 3.14 / 95           14 ms, 42%      0.4 h            3.8 min
  v6e-8   8      data=8   1                 2.34 / 32           20 ms, 7%       0.6 h            4.6 min
  v5e-64  64     data=64  1                 1.37 / 16           16 ms, 7%       0.4 h            2.2 min

The paper: 12 hours on 8 P100s (0.4 s/step). Every slice fits the paper's batch without accumulation; on one
GPU, `--mode=compile` on that machine gives the figures for its memory (train.grad_accum_steps lowers them).

Every default of the code lives here; other configs state only their differences.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # §3: architecture. Field names match transformer_jax.model.transformer.ModelConfig one to one.
  config.model = ml_collections.ConfigDict(dict(
      num_layers=6,
      d_model=512,
      d_ff=2048,
      num_heads=8,
      d_k=64,
      d_v=64,
      dropout_rate=0.1,               # §5.4 P_drop.
      attention_dropout_rate=0.0,     # Not in the paper; kept for ablations.
      activation_dropout_rate=0.0,    # Of the feed-forward's d_ff activations (t2t's relu_dropout); not in the paper.
      position_embedding='sinusoidal',  # §3.5; 'learned' is Table 3 row E; 'rope': rotary (Su et al., 2021).
      layer_norm_position='post',     # §3.1: LayerNorm(x + Sublayer(x)); 'pre' (Xiong et al., 2020) adds a final norm.
      scale_embeddings=True,          # §3.4: multiply embeddings by sqrt(d_model).
      max_length=256,                 # Longest position a learned embedding table holds.
      # Compute dtype of the matrix products (params, softmax, logits and the loss stay float32, as in MaxText and
      # t5x): bfloat16 is what GPUs and TPUs run fast; 'float32' for exact CPU tests (configs/smoke.py).
      dtype='bfloat16',
      attention_impl='xla',           # 'xla' (einsum) or 'fused' (jax.nn.dot_product_attention).
      remat=False,                    # Rematerialise each layer in the backward pass (memory for big).
      # Later variants, not in the paper (Table 3 rows F1-F8, configs/table3.py); the defaults are the paper's.
      norm='layer_norm',              # 'rms_norm': RMSNorm, no bias or mean subtraction (Zhang & Sennrich, 2019).
      feed_forward='relu',            # §3.3 ReLU; 'gelu'; gated 'swiglu' / 'geglu' (Shazeer, 2020).
      num_kv_heads=ml_collections.config_dict.placeholder(int),  # None: num_heads; 1: multi-query; else grouped.
      # The dtype of Q K^T and weights x V: 'compute' (= dtype) or 'float32' (CPU configs: XLA:CPU has no fast
      # batched bf16 product). Changes no parameter; the self-attention decoding cache holds K, V in dtype.
      attention_product_dtype='compute',
      # A decoding step's attention and beam scores: 'auto' (the C++ kernels of transformer_jax.cpu on a single
      # CPU device where a C++ compiler builds them, else XLA), 'cpu' (the kernels, or an error) or 'xla'. Same
      # numbers up to float32 summation order (test_2016_flickr: the same BLEU).
      decoding_kernel='auto',
  ))

  config.data = ml_collections.ConfigDict(dict(
      dataset='wmt14_translate/de-en',  # A TFDS name, 'multi30k', 'text' (see train_files) or 'treebank'.
      source_lang='en',
      target_lang='de',
      train_split='train',
      eval_split='validation',          # newstest2013 for WMT14.
      test_split='test',                # newstest2014 for WMT14.
      manual_dir='',                    # Multi30k: folder with {split}.{lang}.gz; empty means download.
      tfds_data_dir='',                 # Empty means TFDS's default (~/tensorflow_datasets).
      train_files='',                   # dataset='text': 'SOURCE_FILE,TARGET_FILE'.
      eval_files='',
      test_files='',
      # dataset='treebank' (§6.3 parsing, configs/parsing.py): the folder of bracketed trees, WSJ sections
      # (wsj_SSNN.mrg: train 02-21, dev 22, test 23) or train*/dev*/test* files (data/treebank.py).
      treebank_dir='',
      # dataset='treebank': what stands for a word in the output, 'xx' (Vinyals et al. (2015) and §6.3: every
      # POS tag XX) or 'words' (the word itself, which the decoder can follow; not in the paper).
      treebank_target='xx',
      vocab_size=37000,                 # §5.1: shared source-target BPE of about 37,000 tokens.
      tokenizer_model_type='bpe',
      tokenizer_train_sentences=2_000_000,  # Sentences (source + target) sampled to train the vocabulary.
      tokenizer_seed=0,                 # Chooses that sample: same corpus and seed, same vocabulary file.
      tokenizer_normalization='nmt_nfkc',  # SentencePiece's rule; 'identity' keeps '…', full-width digits, ligatures.
      tokens_per_batch=25_000,          # §5.1: ~25,000 source and ~25,000 target tokens per batch.
      max_length=256,                   # Longer training pairs are skipped; longer eval sources truncated.
      bucket_lengths=(8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256),
      packing=False,                    # Pack several pairs per row (segment ids and positions).
      bpe_dropout_rate=0.0,             # BPE-dropout of the training pairs, resampled every epoch; not in the paper.
      shuffle_seed=0,
  ))

  config.train = ml_collections.ConfigDict(dict(
      num_train_steps=100_000,
      warmup_steps=4000,              # §5.3.
      learning_rate_scale=1.0,        # Multiplies the §5.3 schedule; 1.0 is the paper.
      adam_b1=0.9,                    # §5.3.
      adam_b2=0.98,
      adam_eps=1e-9,
      grad_clip_norm=0.0,             # 0 disables clipping (the paper does not clip).
      label_smoothing=0.1,            # §5.4 eps_ls.
      weight_decay=0.0,               # Decoupled (AdamW) on matrices, times the learning rate; 0: the paper's Adam.
      # R-Drop (Liang et al., 2021, Eq. 3; not in the paper): > 0 runs each batch twice, under two dropout masks,
      # and adds α/2 (KL(P1‖P2) + KL(P2‖P1)) of the two passes to their losses. A step costs twice the FLOPs and
      # holds twice the activations; progress lines show the divergence as `kl`. Needs a dropout rate > 0.
      rdrop_alpha=0.0,
      # Micro-batches per update: data.tokens_per_batch is cut into this many, their gradients summed (the
      # paper's batch on fewer devices; see configs/big.py). 1 is the paper's single batch.
      grad_accum_steps=1,
      seed=0,
      log_every_steps=100,
      log_every_secs=30.0,            # Also a progress line once this many seconds passed since the last; 0: off.
      eval_every_steps=5000,
      checkpoint_every_steps=5000,
      max_checkpoints_to_keep=20,     # §6.1 averages the last 20 checkpoints for big.
      on_nonfinite='stop',            # 'stop' or 'skip' the update when loss or gradients are non-finite.
      translate_at_end=True,          # Decode the test split with beam search and print BLEU after training.
      eval_bleu_every_steps=0,        # Validation BLEU (eval.bleu_beam_size) every this many steps; 0: never.
  ))

  config.decode = ml_collections.ConfigDict(dict(
      beam_size=4,                    # §6.1.
      alpha=0.6,                      # §6.1 length penalty (Wu et al., 2016).
      extra_length=50,                # §6.1: maximum output length = input length + 50.
      # When a sentence's search stops: 'bound' (no live hypothesis can beat the worst finished one under the
      # length penalty: what an unbounded search returns; tensor2tensor) or 'finished' (beam_size hypotheses
      # have ended: fairseq, CTranslate2; faster, may give up a longer hypothesis the penalty would prefer).
      early_stopping='bound',
      # Source tokens per decoding batch (each sentence is beam_size rows; raised to data.max_length x data
      # shards where smaller); 0: data.tokens_per_batch. A finished sentence costs its rows until the batch's
      # last one finishes: on CPUs smaller is faster.
      tokens_per_batch=0,
      # On one device, look every this many steps which sentences are done and go on with the others in a
      # smaller batch (decoding.translate.decode_batch_compacted: same output, fewer rows computed, more programs
      # to compile); 0: one compiled search per batch, run until its last sentence ends. On a 2-vCPU Xeon,
      # test_2016_flickr: 1.06-1.25x the sentences/s once compiled, but ~8 s more compilation: worth it for
      # long decodes (break-even near 20k sentences with 'finished', 3k with 'bound'). Ignored over devices.
      compact_every_steps=0,
      # On one device, batches decoded at once, each on its own thread (same output; a cache per batch in
      # flight); 0: on a CPU its cores (at most 4; measured on 2 vCPUs only), on an accelerator 1. On a 2-vCPU
      # Xeon, test_2016_flickr, 'finished', 512 tokens per batch: 1.6-1.7x the sentences/s of one batch at a
      # time with 2, no more with 3 or 4. Over several devices batches go one at a time.
      concurrent_batches=0,
  ))

  config.eval = ml_collections.ConfigDict(dict(
      average_last_n=5,               # §6.1: base averages the last 5 checkpoints (written every 10 min).
      # Which parameters the final evaluation uses: 'average_last' (§6.1: the mean of the last
      # average_last_n checkpoints), 'best' (the checkpoint with the best validation BLEU) or
      # 'average_best' (the mean of the average_best_n best by validation BLEU). The last two need
      # train.eval_bleu_every_steps > 0; <workdir>/best_checkpoints keeps the average_best_n best.
      checkpoint_selection='average_last',
      average_best_n=5,
      bleu_beam_size=0,               # Beam of the validation BLEU during training; 0: decode.beam_size, 1: greedy.
      # The validation metric that train.eval_bleu_every_steps computes and the best checkpoints are chosen by:
      # 'bleu' (translation) or 'f1' (EVALB bracket F1 of dataset='treebank', §6.3; evaluation/parsing.py).
      metric='bleu',
  ))

  # Device mesh: -1 fills the remaining devices. Logical axis rules map the model's names onto mesh axes.
  config.mesh = ml_collections.ConfigDict(dict(
      data=-1,
      fsdp=1,
      tensor=1,
      logical_axis_rules=(
          ('batch', ('data', 'fsdp')),
          ('length', None),
          ('embed', 'fsdp'),
          ('vocab', 'tensor'),
          ('heads', 'tensor'),
          ('kv_heads', None),           # Fewer K/V heads than heads (model.num_kv_heads): replicated.
          ('kv', None),
          ('mlp', 'tensor'),
      ),
  ))

  # --mode=compile (transformer_jax/tools/aot.py): what the train step needs per device, compiled without running it.
  config.compile = ml_collections.ConfigDict(dict(
      # A Cloud TPU slice to compile for with the TPU compiler, on any machine with the `tpu` extra (v4-8,
      # v5e-8 or v5litepod-8, v5p-8, v6e-8, v5e-64, ...); empty: the devices this process sees.
      topology='',
      # With a topology: when the step does not fit a chip's memory, compile again with larger
      # train.grad_accum_steps, then mesh.fsdp, and report the smallest setting that fits.
      find_fit=True,
  ))

  # --mode=export (transformer_jax/tools/export.py): a CTranslate2 model directory for serving.
  config.export = ml_collections.ConfigDict(dict(
      format='ctranslate2',
      quantization='int8',            # CTranslate2's weight type: int8, int8_float32, float32 or bfloat16.
  ))

  config.benchmark = ml_collections.ConfigDict(dict(
      batch_size=0,                   # 0: tokens_per_batch // source_length.
      source_length=32,
      target_length=32,
      num_steps=5,
      decode_sentences=16,
  ))
  return config
