"""Token in, token out: action masks and the increasing-tokenization check."""
import pytest

from train.datasets.tokenize import TokenizationError, continuation_ids, prompt_ids, tokenize_messages

CONV = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "<tool_call>12 + 30</tool_call>"},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "<answer>42</answer>"},
]


def test_action_mask_covers_assistant_content_and_end_of_turn(stub_tokenizer):
    tok = stub_tokenizer
    ids, mask = tokenize_messages(tok, CONV)
    assert len(ids) == len(mask)
    assert ids == tok.encode(tok.apply_chat_template(CONV, tokenize=False), add_special_tokens=False)
    actions = [i for i, m in zip(ids, mask) if m]
    eos = tok.eos_token_id
    # Exactly the two assistant turns, each followed by its sampled end-of-turn token.
    expected = []
    for m in CONV:
        if m["role"] == "assistant":
            expected += tok.encode(m["content"], add_special_tokens=False) + [eos]
    assert actions == expected
    # Template, system, user and tool tokens are not actions.
    text_of_non_actions = tok.decode([i for i, m in zip(ids, mask) if not m])
    for m in CONV:
        if m["role"] != "assistant":
            assert m["content"] in text_of_non_actions


def test_continuation_rebuilds_the_conversation_token_for_token(stub_tokenizer):
    """Prompt + sampled turn + continuation == tokenizing the whole conversation."""
    tok = stub_tokenizer
    ids = prompt_ids(tok, CONV[:2])
    sampled = tok.encode(CONV[2]["content"], add_special_tokens=False) + [tok.eos_token_id]
    ids = ids + sampled + continuation_ids(tok, CONV[:3], [CONV[3]])
    ids += tok.encode(CONV[4]["content"], add_special_tokens=False) + [tok.eos_token_id]
    full, _ = tokenize_messages(tok, CONV)
    # tokenize_messages also renders the template's trailing newline after the last turn.
    assert full[: len(ids)] == ids
    assert tok.decode(full[len(ids):]).strip() == ""


def test_continuation_after_a_stop_string_keeps_the_end_of_turn(stub_tokenizer):
    tok = stub_tokenizer
    cont = continuation_ids(tok, CONV[:3], [CONV[3]], ended_with_eos=False)
    assert cont[0] == tok.eos_token_id  # the template's end-of-turn the model did not sample


class _StrippingTemplate:
    """A tokenizer wrapper whose template drops earlier assistant turns' content (like templates
    that strip reasoning), i.e. one that does not tokenize increasingly."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_token, self.eos_token_id = tok.eos_token, tok.eos_token_id

    def apply_chat_template(self, messages, **kw):
        last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        shown = [dict(m, content="") if m["role"] == "assistant" and i < last else m
                 for i, m in enumerate(messages)]
        return self.tok.apply_chat_template(shown, **kw)

    def encode(self, text, **kw):
        return self.tok.encode(text, **kw)


def test_non_increasing_template_fails_with_what_to_do(stub_tokenizer):
    bad = _StrippingTemplate(stub_tokenizer)
    conv = CONV[:3] + [{"role": "user", "content": "and 1 + 1?"}]
    with pytest.raises(TokenizationError, match="increasingly.*actor.chat_template"):
        continuation_ids(bad, CONV[:3], [conv[3]])
    with pytest.raises(TokenizationError, match="increasingly"):
        tokenize_messages(bad, conv + [{"role": "assistant", "content": "2"}])
