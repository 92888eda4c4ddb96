"""Prompts of about N tokens for a server whose tokenizer we cannot see.

Text is random common English words, seeded per request, so requests differ from their
first word (no server-side prefix cache can make one look faster than it is) and the same
seed gives the same text. Most tokenizers spend about one token per common word; a
calibration request measures the real rate from the server's usage report and
`words_for` scales the word count to hit the target length.
"""

import numpy as np

WORDS = tuple("""
the of and to in is was for on with as by at from that this it be are were have has had
not but or an which one all their there can will would more when who what so if out up
about into than them some time only other new could these two may first then do any like
now over such our man me even most made after also did many before must through back
years where much your way well down should because each just those people how too little
state good very make world still own see men work long get here between both life being
under never day same another know while last might great old year off come since against
go came right used take three small house light water river town market school teacher
morning evening bread stone bridge train window garden field story question answer letter
harbour boat sea shore wind summer winter moon star sky city road street family supper
child children song father mother friend table door book paper music voice bell church
flower fruit tree hill valley tunnel machine news traveller journey careful quiet bright
patient gentle slowly softly simple ordinary wonderful early late near far open close
""".split())


def text_prompt(words: int, seed: int, *key: int) -> str:
    """`words` random words, different for every seed and key (non-negative integers)."""
    rng = np.random.default_rng([seed, words, *key])
    picks = rng.integers(0, len(WORDS), words)
    return " ".join(WORDS[i] for i in picks)


def words_for(tokens: int, tokens_per_word: float) -> int:
    """Words needed for about `tokens` tokens at the measured rate (at least one)."""
    return max(1, round(tokens / max(tokens_per_word, 1e-6)))
