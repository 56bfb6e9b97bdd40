"""A byte-level BPE tokenizer trained offline, for created (random-weight) models.

No tokenizer may be downloaded, so created checkpoints carry one trained on
CPython's own `pydoc_data` topics (present in every CPython, PSF licence):
deterministic, a second to train, and real BPE so prompts have realistic
lengths. It speaks ChatML, so `/v1/chat/completions` works.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{{ message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def training_text() -> list[str]:
    """The offline corpus the tokenizer learns from."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def train_tokenizer(vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with exactly `vocab_size` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    # The corpus supports ~9k merges; larger vocabularies (model shapes for
    # benchmarks) are filled with reserved tokens, as many real tokenizers are.
    learned = tokenizer.get_vocab_size()
    tokenizer.add_special_tokens(
        [f"<|reserved_{i}|>" for i in range(vocab_size - learned)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=ENDOFTEXT,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        chat_template=CHATML_TEMPLATE,
        model_max_length=model_max_length,
    )
