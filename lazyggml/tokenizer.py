"""Text to token ids and back, from a GGUF file's vocabulary, as llama.cpp does it (``llama-vocab.cpp``).

Two kinds of vocabulary, named by ``tokenizer.ggml.model``:

* ``"llama"``: SentencePiece-style (llama.cpp's SPM). Spaces become ``"▁"`` (U+2581) and, with
  ``add_space_prefix``, one is put in front of the text. The text is cut into single characters;
  then, repeatedly, the adjacent pair whose concatenation is the vocabulary token with the highest
  *score* is merged (ties: the leftmost pair). A final piece that is not a token falls back to its
  UTF-8 bytes, the tokens ``<0x00>`` .. ``<0xFF>``.
* ``"gpt2"``: byte-level BPE. A pre-tokenizer, a list of regular expressions named by
  ``tokenizer.ggml.pre``, cuts the text into words; each regex cuts every piece of the previous one
  into its matches and the gaps between them. Each word's UTF-8 bytes are spelled with GPT-2's
  byte-to-unicode alphabet (printable bytes stand for themselves, the others for U+0100 onwards, so
  a space is ``"Ġ"``), then the adjacent pair with the lowest *merge rank* (its line in
  ``tokenizer.ggml.merges``) is merged until none is left.

Control tokens (``<s>``, ``</s>``, ``<|begin_of_text|>`` ...) are matched in the text only when
``parse_special=True``; user-defined tokens always are. ``tokenize(text, add_special=True)`` adds
BOS/EOS as the vocabulary asks (``tokenizer.ggml.add_bos_token`` / ``add_eos_token``, defaulting to
BOS for SPM and Llama 3 vocabularies), as llama.cpp's ``add_special`` does.

``detokenize`` follows llama.cpp's ``llama_detokenize`` too, quirks included: the space that
``add_space_prefix`` added is removed from the first token only, so ``[BOS, "▁Hello"]`` gives
``" Hello"`` while ``["▁Hello"]`` gives ``"Hello"``; BPE vocabularies "clean up" spaces before
``? ! . ,`` and some apostrophes unless their pre-tokenizer turns that off.

The pre-tokenizers use the ``regex`` package (for ``\\p{L}``, ``\\p{N}``, ``\\p{P}``); its Unicode
tables may be a version apart from llama.cpp's, and llama.cpp's hand-written GPT-2 splitter puts an
unassigned code point in a word of its own, so text with unassigned code points may split differently.
"""
from __future__ import annotations

import enum
import heapq
import re
import string

import regex

from .errors import GGUFError
from .gguf_io import get_key

__all__ = ["TokenType", "TokenAttr", "Tokenizer", "PreTokenizer", "PRE_TOKENIZERS", "pre_tokenize",
           "byte_encode", "BYTE_TO_UNICODE", "UNICODE_TO_BYTE", "SPIECE_UNDERLINE",
           "clean_up_tokenization_spaces"]

SPIECE_UNDERLINE = "\u2581"  # "▁", SentencePiece's visible space


class TokenType(enum.IntEnum):
    """The values of ``tokenizer.ggml.token_type`` (llama.cpp's ``llama_token_type``)."""
    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenAttr(enum.IntFlag):
    """llama.cpp's ``llama_token_attr`` bits, derived from the token types."""
    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


_ATTR_OF_TYPE = {TokenType.NORMAL: TokenAttr.NORMAL, TokenType.UNKNOWN: TokenAttr.UNKNOWN,
                 TokenType.CONTROL: TokenAttr.CONTROL, TokenType.USER_DEFINED: TokenAttr.USER_DEFINED,
                 TokenType.UNUSED: TokenAttr.UNUSED, TokenType.BYTE: TokenAttr.BYTE}

# tokens that end generation, recognised by their text as llama.cpp does (and then made CONTROL)
_EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                        "<|end_of_text|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "</s>",
                        "<end_of_utterance>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                        "<eos>", "<turn|>", "<|tool_response>"})
# fill-in-the-middle tokens whose file key is missing, found by their text as llama.cpp does (the
# first present, made CONTROL); these three end generation too (Qwen's vocabularies have them)
_FIM_EOG_TEXTS = {"fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
                  "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
                  "fim_sep": ("<|file_sep|>",)}

# --- GPT-2's byte <-> unicode alphabet -------------------------------------------------------------


def _byte_alphabet() -> list:
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, n = [], 0
    for b in range(256):
        if b in printable:
            table.append(chr(b))
        else:
            table.append(chr(256 + n))
            n += 1
    return table


BYTE_TO_UNICODE = _byte_alphabet()
UNICODE_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_UNICODE)}


def byte_encode(text: str) -> str:
    """Spell the UTF-8 bytes of ``text`` in GPT-2's byte alphabet (one character per byte)."""
    return "".join(BYTE_TO_UNICODE[b] for b in text.encode("utf-8", "surrogatepass"))


# --- pre-tokenizers -----------------------------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama 3's regex as llama.cpp writes it: the case-insensitive contractions spelled out
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


class PreTokenizer:
    """A named llama.cpp pre-tokenizer: its regexes and the vocabulary flags it implies."""

    def __init__(self, regexes, *, clean_spaces=True, ignore_merges=False, add_bos=False):
        self.regexes = [regex.compile(r) for r in regexes]
        self.clean_spaces = clean_spaces    # llama.cpp's clean_up_tokenization_spaces
        self.ignore_merges = ignore_merges  # a whole word that is a token is taken as it is
        self.add_bos = add_bos              # the default of tokenizer.ggml.add_bos_token

    def split(self, text: str) -> list:
        """Cut ``text`` into words: each regex cuts every piece into its matches and the gaps."""
        pieces = [text] if text else []
        for rx in self.regexes:
            out = []
            for piece in pieces:
                pos = 0
                for m in rx.finditer(piece):
                    if m.start() > pos:
                        out.append(piece[pos:m.start()])
                    if m.end() > m.start():
                        out.append(m.group())
                    pos = m.end()
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        return pieces


_LLAMA3_PRE = PreTokenizer([_LLAMA3], ignore_merges=True, add_bos=True)
_GPT2_PRE = PreTokenizer([_GPT2])
_STARCODER_RES = [r"\p{N}", _GPT2]
PRE_TOKENIZERS = {
    "default": PreTokenizer([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]),
    "gpt-2": _GPT2_PRE,
    "gpt2": _GPT2_PRE,  # not a name llama.cpp knows; accepted as the obvious alias of "gpt-2"
    "llama3": _LLAMA3_PRE,
    "llama-v3": _LLAMA3_PRE,
    "llama-bpe": _LLAMA3_PRE,
    "smollm": PreTokenizer(_STARCODER_RES, clean_spaces=False),
    "starcoder": PreTokenizer(_STARCODER_RES),
    "qwen2": PreTokenizer([_QWEN2], clean_spaces=False),
}


def pre_tokenize(text: str, pre: str = "default") -> list:
    """The words the BPE pre-tokenizer ``pre`` cuts ``text`` into (before byte encoding)."""
    return PRE_TOKENIZERS[pre].split(text)


# --- clean-up of decoded BPE text (llama.cpp's clean_spaces) ----------------------------------------

_CLEAN_PASSES = [(re.compile(rb" ([?!.,])"), rb"\1"),      # "hello ." -> "hello."
                 (re.compile(rb" ' "), rb"'"),             # a lone apostrophe between spaces
                 (re.compile(rb" '(?=[sm]|re|ve)"), rb"'")]  # " 's", " 'm", " 're", " 've"


def clean_up_tokenization_spaces(text: bytes) -> bytes:
    """Remove the spaces that llama.cpp's detokenizer removes for BPE vocabularies, in its three
    left-to-right passes."""
    for rx, repl in _CLEAN_PASSES:
        text = rx.sub(repl, text)
    return text


def _hex_prefix(s: str) -> int:
    """The byte value of a BYTE token ``<0xXX>``: its leading hex digits, as llama.cpp's ``strtol``
    reads ``text[3:5]`` (0 when there are none)."""
    digits = ""
    for c in s:
        if c not in string.hexdigits:
            break
        digits += c
    return int(digits, 16) if digits else 0


class Tokenizer:
    """The vocabulary of a GGUF file and its tokenizer.

    ``Tokenizer(metadata, path)`` reads ``tokenizer.ggml.*`` from a GGUF file's metadata dict
    (``read_gguf(path).metadata``) and raises ``GGUFError`` for a vocabulary llama.cpp would refuse
    or lazyggml does not support. Attributes: ``model`` ("llama" or "gpt2"), ``pre`` (the BPE
    pre-tokenizer name, None for SPM), ``tokens``, ``scores``, ``attrs`` (``TokenAttr`` per token),
    ``n_vocab``, ``bos_id``, ``eos_id``, ``unk_id`` (None when absent), ``add_bos``, ``add_eos``,
    ``add_space_prefix``, ``clean_spaces``, ``eog_ids`` (the ids that end generation: EOS, EOT, EOM
    and, as llama.cpp finds them by their text, the end-of-turn tokens of chat templates such as
    ``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>``, and Qwen's FIM pad/repo/file tokens).
    """

    def __init__(self, metadata: dict, path="<metadata>"):
        self.path = p = str(path)
        meta = metadata
        self.model = get_key(meta, p, "tokenizer.ggml.model", "str", required=True)
        if self.model not in ("llama", "gpt2"):
            raise GGUFError(p, "tokenizer.ggml.model",
                            f"unsupported tokenizer {self.model!r}; lazyggml reads 'llama' and 'gpt2'")
        tokens = self._array(meta, "tokenizer.ggml.tokens", str, required=True)
        self.n_vocab = n = len(tokens)
        if n == 0:
            raise GGUFError(p, "tokenizer.ggml.tokens", "the vocabulary is empty")
        # llama.cpp renames empty tokens rather than refusing them
        self.tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._token_to_id = {}
        self._pieces = {}       # (token, special) -> bytes, as token_to_piece makes them
        for i, t in enumerate(self.tokens):
            if self._token_to_id.setdefault(t, i) != i:
                raise GGUFError(p, f"tokenizer.ggml.tokens[{i}]",
                                f"duplicate token {t!r} (also id {self._token_to_id[t]})")
        scores = self._array(meta, "tokenizer.ggml.scores", (int, float), min_len=n)
        self.scores = [float(s) for s in scores[:n]] if scores is not None else [0.0] * n
        types = self._array(meta, "tokenizer.ggml.token_type", int, min_len=n)
        self.attrs = ([_ATTR_OF_TYPE.get(t, TokenAttr.UNDEFINED) for t in types[:n]]
                      if types is not None else [TokenAttr.NORMAL] * n)

        spm = self.model == "llama"
        if spm:
            self.pre = None
            pre = None
            defaults = {"bos": 1, "eos": 2, "unk": 0}
        else:
            self.pre = get_key(meta, p, "tokenizer.ggml.pre", "str", "default")
            pre = PRE_TOKENIZERS.get(self.pre)
            if pre is None:
                raise GGUFError(p, "tokenizer.ggml.pre", f"unsupported pre-tokenizer {self.pre!r}; "
                                                         f"supported: {sorted(PRE_TOKENIZERS)}")
            defaults = {"bos": 11, "eos": 11, "unk": None}  # llama.cpp's (GPT-2 era) defaults
            merges = self._array(meta, "tokenizer.ggml.merges", str, required=True)
            self._bpe_ranks = {}
            for rank, merge in enumerate(merges):
                cut = merge.find(" ", 1)
                if cut > 0:
                    self._bpe_ranks.setdefault((merge[:cut], merge[cut + 1:]), rank)
        self._pre = pre
        self.bos_id = self._special_id(meta, "bos_token_id", defaults["bos"])
        self.eos_id = self._special_id(meta, "eos_token_id", defaults["eos"])
        self.unk_id = self._special_id(meta, "unknown_token_id", defaults["unk"])
        self.add_space_prefix = get_key(meta, p, "tokenizer.ggml.add_space_prefix", "bool", spm)
        self.add_bos = get_key(meta, p, "tokenizer.ggml.add_bos_token", "bool", spm or pre.add_bos)
        self.add_eos = get_key(meta, p, "tokenizer.ggml.add_eos_token", "bool", False)
        for flag, key in ((self.add_bos, "bos"), (self.add_eos, "eos")):
            if flag and getattr(self, key + "_id") is None:
                raise GGUFError(p, f"tokenizer.ggml.add_{key}_token",
                                f"is true, but tokenizer.ggml.{key}_token_id is not set")
        self.clean_spaces = not spm and pre.clean_spaces
        self._ignore_merges = not spm and pre.ignore_merges

        eog = {self.eos_id, self._special_id(meta, "eot_token_id", None),
               self._special_id(meta, "eom_token_id", None)}
        for key, texts in _FIM_EOG_TEXTS.items():
            tid = self._special_id(meta, f"{key}_token_id", None)
            if tid is None:
                tid = next((self._token_to_id[t] for t in texts if t in self._token_to_id), None)
                if tid is not None:
                    self.attrs[tid] |= TokenAttr.CONTROL
            eog.add(tid)
        for i, t in enumerate(self.tokens):
            if t in _EOG_TEXTS:
                eog.add(i)
                self.attrs[i] |= TokenAttr.CONTROL
        # llama.cpp's two exceptions: where <|end|> closes a message before a tool call or a final
        # answer (gpt-oss, Solar Open) it does not end generation, nor does </s> next to Gemma 4's
        # <|tool_response>; they become plain text tokens
        by_text = {self.tokens[i]: i for i in eog if i is not None}
        if "<|end|>" in by_text and ({"<|call|>", "<|calls|>"} & by_text.keys()) and \
                ({"<|return|>", "<|flush|>"} & by_text.keys()):
            eog.discard(by_text["<|end|>"])
            self.attrs[by_text["<|end|>"]] = TokenAttr.USER_DEFINED
        if "<|tool_response>" in by_text and "</s>" in by_text:
            eog.discard(by_text["</s>"])
            self.attrs[by_text["</s>"]] = TokenAttr.NORMAL
        self.eog_ids = frozenset(eog - {None})
        # the special tokens matched in raw text, longest first (llama.cpp's cache_special_tokens)
        special = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN
        self._special_tokens = sorted((i for i in range(n) if self.attrs[i] & special),
                                      key=lambda i: -len(self.tokens[i]))
        # llama.cpp drops the whitespace after special tokens in Phi-3's vocabularies, told by the
        # model's name ("\n" after "<|user|>" in its chat template is not a token there)
        self._rstrip = frozenset()
        name = get_key(meta, p, "general.name", "str", "").lower()
        if "phi-3" in name or "phi3" in name:
            keep = {self._token_to_id.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")}
            self._rstrip = frozenset(set(self._special_tokens) | {self._token_to_id.get("</s>")}) - keep - {None}
        # byte -> token for SPM's byte fallback: <0xXX>, else the byte itself as a one-char token
        self._byte_tokens = [self._token_to_id.get(f"<0x{b:02X}>",
                                                   self._token_to_id.get(chr(b)) if b < 0x80 else None)
                             for b in range(256)]

    def _array(self, meta, key, item_type, required=False, min_len=0):
        v = meta.get(key)
        if v is None:
            if required:
                raise GGUFError(self.path, key, "required key is missing")
            return None
        if not isinstance(v, list) or not all(isinstance(x, item_type) and not isinstance(x, bool)
                                              for x in v):
            raise GGUFError(self.path, key, f"expected an array of {getattr(item_type, '__name__', 'numbers')}")
        if len(v) < min_len:
            raise GGUFError(self.path, key, f"has {len(v)} entries for {min_len} tokens")
        return v

    def _special_id(self, meta, name, default):
        """A special token id: ``tokenizer.ggml.<name>`` when it is a valid id, else the default; an
        id out of the vocabulary is ignored, as llama.cpp does (with a warning)."""
        key = f"tokenizer.ggml.{name}"
        v = get_key(meta, self.path, key, "int", None)
        if v is not None and 0 <= v < self.n_vocab:
            return v
        return default if default is not None and default < self.n_vocab else None

    # --- text -> ids --------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list:
        """Token ids of ``text``. ``add_special``: add BOS/EOS as the vocabulary asks;
        ``parse_special``: recognise control tokens written in the text (``"<s>"``)."""
        out = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        prev_special = True  # SPM: a space prefix goes at the start and after each special token
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            elif self.model == "llama":
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                self._tokenize_spm(frag.replace(" ", SPIECE_UNDERLINE), out)
                prev_special = False
            else:
                for word in self._pre.split(frag):
                    self._tokenize_bpe_word(byte_encode(word), out)
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list:
        """Cut the text at special tokens: a list of str fragments and int token ids."""
        frags = [text] if text else []
        for tid in self._special_tokens:
            if not parse_special and self.attrs[tid] & (TokenAttr.CONTROL | TokenAttr.UNKNOWN):
                continue
            needle = self.tokens[tid]
            cut = []
            for frag in frags:
                if isinstance(frag, int):
                    cut.append(frag)
                    continue
                for k, part in enumerate(frag.split(needle)):
                    if k:
                        cut.append(tid)
                        if tid in self._rstrip:
                            part = part.lstrip(" \t\n\v\f\r")   # C's isspace
                    if part:
                        cut.append(part)
            frags = cut
        return frags

    def _tokenize_spm(self, text: str, out: list) -> None:
        """SentencePiece merges by score over the characters of ``text`` (spaces already "▁")."""
        n = len(text)
        if n == 0:
            return
        # symbol i covers text[start[i] : start[i] + size[i]]; a merged-away symbol has size 0
        start = list(range(n))
        size = [1] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n)) + [-1]
        queue = []  # (-score, left, right, merged length): best score first, then leftmost

        def add_pair(left, right):
            if left < 0 or right < 0:
                return
            piece = text[start[left]:start[left] + size[left] + size[right]]
            tid = self._token_to_id.get(piece)
            if tid is not None:
                heapq.heappush(queue, (-self.scores[tid], left, right, len(piece)))

        for i in range(1, n):
            add_pair(i - 1, i)
        while queue:
            _, left, right, length = heapq.heappop(queue)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
                continue  # one side was merged since this pair was queued
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[left] >= 0:
                prev[nxt[left]] = left
            add_pair(prev[left], left)
            add_pair(left, nxt[left])

        i = 0
        while i >= 0:
            piece = text[start[i]:start[i] + size[i]]
            tid = self._token_to_id.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._byte_token(b) for b in piece.encode("utf-8", "surrogatepass"))
            i = nxt[i]

    def _byte_token(self, b: int) -> int:
        """The token of byte ``b``; ``<unk>`` when the vocabulary has none (llama.cpp throws here,
        SentencePiece emits ``<unk>``; an SPM vocabulary always has an unknown-token id)."""
        tid = self._byte_tokens[b]
        return self.unk_id if tid is None else tid

    def _tokenize_bpe_word(self, word: str, out: list) -> None:
        """Byte-level BPE merges by rank over one byte-encoded word."""
        if self._ignore_merges and word in self._token_to_id:
            out.append(self._token_to_id[word])
            return
        syms = list(word)  # one character per byte; a merged-away symbol becomes ""
        n = len(syms)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n)) + [-1]
        queue = []  # (rank, left, right, merged text): lowest rank first, then leftmost

        def add_pair(left, right):
            if left < 0 or right < 0:
                return
            rank = self._bpe_ranks.get((syms[left], syms[right]))
            if rank is not None:
                heapq.heappush(queue, (rank, left, right, syms[left] + syms[right]))

        for i in range(1, n):
            add_pair(i - 1, i)
        while queue:
            _, left, right, merged = heapq.heappop(queue)
            if not syms[left] or not syms[right] or syms[left] + syms[right] != merged:
                continue  # outdated
            syms[left] = merged
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[left] >= 0:
                prev[nxt[left]] = left
            add_pair(prev[left], left)
            add_pair(left, nxt[left])

        for sym in syms:
            if not sym:
                continue
            tid = self._token_to_id.get(sym)
            if tid is not None:
                out.append(tid)
                continue
            # not a token: llama.cpp looks up each byte of the symbol's UTF-8 spelling as a
            # one-byte token, which only an ASCII byte can be, and drops the rest
            for b in sym.encode("utf-8"):
                tid = self._token_to_id.get(chr(b)) if b < 0x80 else None
                if tid is not None:
                    out.append(tid)

    # --- ids -> text --------------------------------------------------------------------------

    def _check_id(self, token) -> int:
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} is out of the vocabulary [0, {self.n_vocab})")
        return token

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes token ``token`` stands for (possibly part of a UTF-8 character). Control and
        unknown tokens give ``b""`` unless ``special``; unused/undefined tokens always do.

        Generation asks once a token: the pieces are kept once made (the flag tests and string
        work took ~10 µs, 2% of the embedded model's decode step)."""
        piece = self._pieces.get((token, special))
        if piece is None:
            piece = self._pieces[(token, special)] = self._make_piece(self._check_id(token), special)
        return piece

    def _make_piece(self, token, special):
        attr = self.attrs[token]
        text = self.tokens[token]
        if attr & (TokenAttr.UNKNOWN | TokenAttr.CONTROL):
            return text.encode() if special else b""
        if attr & TokenAttr.USER_DEFINED:
            return text.encode()
        if attr & TokenAttr.NORMAL:
            if self.model == "llama":
                return text.replace(SPIECE_UNDERLINE, " ").encode()
            return self._byte_decode(text)
        if attr & TokenAttr.BYTE:
            return bytes([_hex_prefix(text[3:5])])
        return b""

    @staticmethod
    def _byte_decode(text: str) -> bytes:
        """Undo GPT-2's byte alphabet; a character outside it is written out as llama.cpp does."""
        out = bytearray()
        for c in text:
            b = UNICODE_TO_BYTE.get(c)
            if b is None:
                out += f"[UNK_BYTE_0x{c.encode().hex()}{text}]".encode()
            else:
                out.append(b)
        return bytes(out)

    def detokenize(self, tokens, remove_special: bool = False, unparse_special: bool = False) -> str:
        """The text of ``tokens``: their pieces joined, the first one's prefix space removed (when the
        vocabulary adds one), BPE spaces cleaned up, then decoded as UTF-8 (an incomplete or invalid
        byte sequence becomes U+FFFD). ``remove_special`` drops a leading BOS / trailing EOS that the
        vocabulary adds; ``unparse_special`` writes control tokens out as their text."""
        tokens = [self._check_id(int(t)) for t in tokens]
        strip_space = self.add_space_prefix
        if remove_special and self.add_bos and tokens and tokens[0] == self.bos_id:
            strip_space = False
            tokens = tokens[1:]
        if remove_special and self.add_eos and tokens and tokens[-1] == self.eos_id:
            tokens = tokens[:-1]
        out = bytearray()
        for t in tokens:
            piece = self.token_to_piece(t, unparse_special)
            if strip_space and piece.startswith(b" "):
                piece = piece[1:]
            strip_space = False
            out += piece
        data = clean_up_tokenization_spaces(bytes(out)) if self.clean_spaces else bytes(out)
        return data.decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS, EOT, ``<|eot_id|>`` ...)."""
        return token in self.eog_ids
