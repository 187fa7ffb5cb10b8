"""What every speaking tiny checkpoint shares, below the families that build one (docs/speaking-model.md).

A family's speaking checkpoint is its rules (which codec id its Talker says for the rows it reads),
the weights that make its Talker follow them, the build that writes the checkpoint and a self-check;
the pieces that are the same for every family live here, parametrised by the family's numbers:

* ``rules``: the speaking table (speech id ``256 * tag + byte``, babble, silence, codec EOS) and the
  read-back of a codec stream (``Spoken``, ``decode_table``); pure, no torch;
* ``weights``: the hand-built Talker pieces (the rotary previous-position head, the logit design as
  ``codec_head`` rows, GPT-2's byte map); torch imported inside the functions;
* ``checkpoint``: the build's file handling (a fresh folder, the byte-level tokenizer, safetensors and
  JSON files, the ``omni_stress_tiny_model.json`` marker, the builder's command line);
* ``selfcheck``: the self-check's sampling probability and command line.

Nothing here imports ``harness.families``: a family imports these and keeps only its model's specifics.
"""
