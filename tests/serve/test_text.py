"""The text path of the server without a model: the byte tokenizer, the incremental detokeniser on
characters split across tokens, and the stop-string matcher on text arriving in random pieces, each
against a whole-text reference."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from unimem_compile.serve.text import ByteCodec, IncrementalDetokenizer, StopMatcher

CODEC = ByteCodec(1024)
# one-, two-, three- and four-byte UTF-8 characters
ALPHABET = "ab z.é€✓😀\n"


def _chunks(seq, rng):
    out, i = [], 0
    while i < len(seq):
        n = rng.randint(1, 4)
        out.append(seq[i:i + n])
        i += n
    return out


def test_byte_codec_round_trips_text_and_aliases_high_ids():
    text = "héllo ✓ 😀"
    ids = CODEC.encode(text)
    assert ids[0] == CODEC.bos_token_id and ids[1:] == [b + 3 for b in text.encode()]
    assert CODEC.decode(ids) == text
    # ids past 258 are the byte (id - 3) % 256; 0, 1, 2 are specials and no text
    assert CODEC.decode([256 + 3 + ord("A"), 0, 1, 2, ord("B") + 3]) == "AB"


def test_chat_template_renders_roles_and_the_generation_prompt():
    ids = CODEC.chat_ids([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi ✓"}])
    assert CODEC.decode(ids) == "<|system|>\nbe brief\n<|user|>\nhi ✓\n<|assistant|>\n"
    assert ids[0] == CODEC.bos_token_id and ids.count(CODEC.bos_token_id) == 1


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=ALPHABET, min_size=1, max_size=40), st.integers(0, 2**31))
def test_detokenizer_deltas_concatenate_to_the_whole_text(text, seed):
    rng = random.Random(seed)
    ids = [b + 3 for b in text.encode()]
    detok = IncrementalDetokenizer(CODEC.decode, prompt_tail=CODEC.encode("ctx ✓")[-3:])
    deltas = [detok.push(c) for c in _chunks(ids, rng)] + [detok.flush()]
    assert "".join(deltas) == text
    # a delta never ends inside a character: no replacement character ever appears for valid UTF-8
    assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=40), st.integers(0, 2**31))
def test_detokenizer_on_invalid_utf8_matches_a_whole_decode(data, seed):
    # random weights emit any byte sequence: the streamed text must equal the text decoded at once
    rng = random.Random(seed)
    ids = [b + 3 for b in data]
    detok = IncrementalDetokenizer(CODEC.decode)
    streamed = "".join(detok.push(c) for c in _chunks(ids, rng)) + detok.flush()
    assert streamed == data.decode("utf-8", errors="replace")


def _reference_stop(text, stops):
    # the first prefix of the whole text that contains a stop string decides
    for end in range(1, len(text) + 1):
        hits = [text[:end].find(s) for s in stops if s and s in text[:end]]
        if hits:
            return text[:min(hits)], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abc✓", max_size=30), st.lists(st.text(alphabet="abc✓", min_size=1, max_size=4),
                                                       max_size=4), st.integers(0, 2**31))
def test_stop_matcher_equals_trimming_the_whole_text_however_it_is_cut(text, stops, seed):
    rng = random.Random(seed)
    matcher = StopMatcher(stops)
    out = "".join(matcher.push(c) for c in _chunks(text, rng)) + matcher.flush()
    expected, stopped = _reference_stop(text, stops)
    assert (out, matcher.stopped) == (expected, stopped)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abc✓", max_size=30), st.lists(st.text(alphabet="abc✓", min_size=1, max_size=4),
                                                       max_size=4), st.integers(0, 30), st.integers(0, 2**31))
def test_unarmed_text_ends_no_match_but_a_match_it_begins_still_counts(text, stops, armed_at, seed):
    # min_tokens: the text before character `armed_at` is pushed unarmed; the reply ends at the first match
    # that ends at or after it (vLLM: stop strings are not checked before min_tokens)
    armed_at = min(armed_at, len(text))
    rng = random.Random(seed)
    matcher = StopMatcher(stops)
    out = "".join(matcher.push(c, armed=False) for c in _chunks(text[:armed_at], rng))
    out += "".join(matcher.push(c) for c in _chunks(text[armed_at:], rng)) + matcher.flush()
    expected, stopped = text, False
    for end in range(armed_at + 1, len(text) + 1):
        hits = [end - len(s) for s in stops if text.endswith(s, 0, end)]
        if hits:
            expected, stopped = text[:min(hits)], True
            break
    assert (out, matcher.stopped) == (expected, stopped)


def test_stop_matcher_holds_back_a_possible_match_and_stops_on_the_earliest():
    m = StopMatcher(["STOP", "ab"])
    assert m.push("xxS") == "xx"  # "S" may begin "STOP": held
    assert m.push("T") == ""
    assert m.push("y") == "STy"  # "STy" begins no stop string
    assert m.push("a") == ""
    assert m.push("Tab STOP") == "aT"  # "ab" comes first
    assert m.stopped and m.push("more") == "" and m.flush() == ""
