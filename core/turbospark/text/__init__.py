"""Text for an install: its tokenizer, its chat template, its stop ids and stop strings.

Everything here reads the files a Hugging Face checkpoint ships beside its
weights (``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``), so a real checkpoint and a synthetic install take
the same path. One module per job:

* :mod:`~turbospark.text.tokenizer_files` -- the parts of those JSON files generation needs;
* :mod:`~turbospark.text.templates` -- rendering a checkpoint's jinja2 chat template
  as ``transformers`` does, and the built-in families' template shapes;
* :mod:`~turbospark.text.codec` -- :class:`TextCodec` (encode, decode, chat) and the
  streaming detokenizer;
* :mod:`~turbospark.text.stops` -- cutting a text stream at stop strings.

The small synthetic tokenizers the tests use are built beside the synthetic
weights, in :mod:`turbospark.loading.synthetic`.
"""

from turbospark.text.codec import ChatMessage, StreamDecoder, TextCodec, load_text
from turbospark.text.stops import StopStrings

__all__ = ["ChatMessage", "StopStrings", "StreamDecoder", "TextCodec", "load_text"]
