"""Gated DeltaNet: the linear-attention layer of Qwen3.5-style hybrids, and its state.

Per value head the layer keeps a matrix ``S`` (``(Dv, Dk)``) and, per token,

    S_t = g_t * S_{t-1} + beta_t * (v_t - g_t * S_{t-1} k_t) k_t^T,      y_t = S_t q_t

(the *gated delta rule*: decay by ``g``, then one delta-rule step towards
``v_t`` along ``k_t``). Decode uses the step directly. Prefill uses the
chunkwise (WY) form of "Gated Delta Networks" (Yang et al., 2024): inside a
chunk the deltas solve a unit lower-triangular system, so a chunk of ``C``
tokens costs a few ``C x C`` and ``C x D`` matmuls and only the state carry
between chunks is sequential. A draft's verify pass is one such chunk that
also hands back its deltas, from which the state after any of its tokens is
one matmul, built only when drafts were rejected (:func:`gated_delta_traced`,
:func:`traced_layer`); on a GPU, where kernels cost more than arithmetic, a
short pass steps token by token instead and keeps every token's state
(:func:`mix_unrolled`). Every form computes in float32. On MLX's CUDA
backend every one of these is instead one kernel for the recurrence, its q/k
norm and gates (:mod:`turbospark.layers.cuda.gdn`, through :func:`mix_kernel`),
whatever the length; the forms above serve the CPU and Metal.

Shapes follow mlx-lm's ``gated_delta.py`` so checkpoints and states line up:
q/k ``(B, T, Hk, Dk)``, v ``(B, T, Hv, Dv)``, gates ``(B, T, Hv)``, state
``(B, Hv, Dv, Dk)`` float32. ``Hv`` must be a multiple of ``Hk`` (grouped heads).

Families import the pieces (through :mod:`turbospark.sdk`): :class:`GatedDeltaNet` (HF parameter names
``in_proj_qkv/z/b/a``, ``conv1d``, ``A_log``, ``dt_bias``, ``norm``,
``out_proj``), the functions it is built from, :class:`GDNComponent`, and
:func:`gated_delta_layer_step`, a pre-norm layer's decode step with this mixer as
one traced call where the CUDA kernels run.

One job per module: :mod:`.gates` (gates, normalisation, convolution),
:mod:`.rule` (the recurrence in every form), :mod:`.layer` (the mixer and its
passes), :mod:`.state` (the session state), :mod:`.step` (a layer's
one-trace decode step).
"""
