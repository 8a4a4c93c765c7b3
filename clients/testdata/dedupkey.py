#!/usr/bin/python3
"""Writes dedupkey.json, the DedupKey vectors every implementation tests against.

    /usr/bin/python3 clients/testdata/dedupkey.py

Each case gives the inputs of DedupKey (Go clients.DedupKey, Node dedupKey,
Python idemcoord.dedup_key), the name as NormalizeName must leave it (written
here by hand, from the specification in clients/dedup.go, never computed by
an implementation) and the key. The key is derived from the hand-written
normalized name by the key format alone: intent:user:p:<project id>, or
intent:user:n:<first 16 hex digits of sha256(utf-8 of normalized name)>.
"""

import hashlib
import json
import os
import unicodedata

WHITE_SPACE = ("\t\n\u000b\u000c\r \u0085\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
               "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")

# (comment, project_name, normalized); intent "create-project", user "u1",
# no project id, unless a case says otherwise.
NAMES = [
    ("plain", "flower shop", "flower shop"),
    ("trim, lower, fold", " Flower  Shop ", "flower shop"),
    ("tab and newline", "FLOWER\tSHOP\n", "flower shop"),
    ("no-break space is White_Space", "flower \u00a0 shop", "flower shop"),
    ("leading byte-order mark", "\ufeffFlower Shop", "flower shop"),
    ("byte-order mark inside a word", "Flo\ufeffwer Shop", "flower shop"),
    ("byte-order mark between spaces", " \ufeff Flower \ufeff ", "flower"),
    ("only byte-order marks", "\ufeff\ufeff", ""),
    ("U+0085 NEXT LINE separates words", "Flower\u0085Shop", "flower shop"),
    ("U+0085 NEXT LINE is trimmed", "\u0085Flower Shop\u0085", "flower shop"),
    ("line and paragraph separators", "Flower\u2028\u2029Shop", "flower shop"),
    ("ideographic space", "Flower\u3000Shop", "flower shop"),
    ("every White_Space character folds to one space", "a" + WHITE_SPACE + "b", "a b"),
    ("zero width space is not White_Space", "Flower\u200bShop", "flower\u200bshop"),
    ("U+180E is not White_Space (since Unicode 6.3)", "A\u180eB", "a\u180eb"),
    ("information separators U+001C-U+001F are not White_Space", "A\u001c\u001d\u001e\u001fB", "a\u001c\u001d\u001e\u001fb"),
    ("capital I with dot above: full mapping to i + U+0307", "İstanbul", "i\u0307stanbul"),
    ("capital I is i, İ is i + U+0307 (no Turkish rules)", "DİYARBAKIR", "di\u0307yarbakir"),
    ("dotless i stays", "ılık", "ılık"),
    ("word-final capital sigma", "ΟΔΟΣ", "οδος"),
    ("final sigma in two words", "ΟΔΟΣ ΣΟΦΟΣ", "οδος σοφος"),
    ("a lone sigma is not final", "Σ", "σ"),
    ("sigma after a digit is not final", "1Σ", "1σ"),
    ("sigma before punctuation is final", "ΣΑΣ.", "σας."),
    ("case-ignorable apostrophe after a final sigma", "ΑΣ'", "ας'"),
    ("sigma followed by apostrophe then a letter is not final", "ΑΣ'Β", "ασ'β"),
    ("soft hyphen is case-ignorable before sigma", "Α\u00adΣ", "α\u00adς"),
    ("sigma followed by a combining mark is final", "ΑΣ\u0301", "ας\u0301"),
    ("byte-order mark removed before lower-casing the sigma", "ΠΑΣ\ufeff ΚΑΙ", "πας και"),
    ("sigma before a removed byte-order mark and a letter", "ΑΣ\ufeffΒ", "ασβ"),
    ("NFC composes before lower-casing", "Cafe\u0301", "caf\u00e9"),
    ("precomposed and decomposed agree", "CAF\u00c9", "caf\u00e9"),
    ("Greek omicron + combining acute composes to U+038C", "Ο\u0301ΔΟΣ", "\u03ccδος"),
    ("Angstrom sign: NFC to U+00C5, then U+00E5", "\u212b", "\u00e5"),
    ("Kelvin sign: NFC to K, then k", "\u212a", "k"),
    ("Ohm sign: NFC to U+03A9, then omega", "\u2126", "\u03c9"),
    ("Hangul jamo compose", "\u1112\u1161\u11ab", "\ud55c"),
    ("capital sharp s", "GRO\u1e9eE", "gro\u00dfe"),
    ("titlecase digraph", "\u01c5ak", "\u01c6ak"),
    ("roman numeral", "Ⅻ", "ⅻ"),
    ("fullwidth Latin", "ＦＬＯＷＥＲ", "ｆｌｏｗｅｒ"),
    ("Deseret, outside the BMP", "\U00010400\U00010401", "\U00010428\U00010429"),
    ("Cherokee lower-cases to U+AB70 block", "ᏣᎳᎩ", "\uabb3\uab83\uab79"),
    ("Georgian Mtavruli", "\u1c90\u1c91\u1c92", "\u10d0\u10d1\u10d2"),
    ("Cyrillic", "МОСКВА", "москва"),
    ("Armenian", "ԵՐԵՎԱՆ", "երեվան"),
    ("mixed scripts", " Ελληνικά and  Русский\t中文 ", "ελληνικά and русский 中文"),
    ("CJK has no case", "花店", "花店"),
    ("Arabic", "متجر  الزهور", "متجر الزهور"),
    ("Devanagari with combining signs", "नमस्ते", "नमस्ते"),
    ("emoji", "🌸 Flower Shop 🌸", "🌸 flower shop 🌸"),
    ("emoji ZWJ sequence keeps U+200D", "👩\u200d💻 DEV", "👩\u200d💻 dev"),
    ("emoji variation selector and skin tone", "❤\ufe0f SHOP 👍🏽", "❤\ufe0f shop 👍🏽"),
    ("flag", "🇩🇪 Laden", "🇩🇪 laden"),
    ("empty name", "", ""),
    ("all spaces", "   ", ""),
    ("all kinds of White_Space", "\t\n\u0085\u00a0\u3000\u2028", ""),
    ("a lone surrogate becomes U+FFFD", "\ud800Shop", "\ufffdshop"),
    ("a long name", "Flower Shop " * 30, ("flower shop " * 30).strip()),
]

EXTRA = [
    # (comment, intent, user_id, project_id, project_name, normalized)
    ("a project id wins over the name", "rename-project", "u1", "prj_7", "Ignored", "ignored"),
    ("a project id is used as it is", "rename-project", "u1", "PRJ İ", "", ""),
    ("intent and user are used as they are", "Créer", "ÜSER 7", "", "Flower Shop", "flower shop"),
    ("another user gets another key", "create-project", "u2", "", "Flower Shop", "flower shop"),
]


def key(intent, user_id, project_id, normalized):
    if project_id:
        return "%s:%s:p:%s" % (intent, user_id, project_id)
    raw = normalized.encode("utf-8")
    return "%s:%s:n:%s" % (intent, user_id, hashlib.sha256(raw).hexdigest()[:16])


def visible(ch):
    """Whether a character may appear unescaped in the JSON file."""
    if ch == " ":
        return True
    if 0xD800 <= ord(ch) <= 0xDFFF:
        return False
    if 0x1100 <= ord(ch) <= 0x11FF:  # conjoining Hangul jamo look composed
        return False
    return unicodedata.category(ch)[0] in "LNPS"


def dumps(value):
    """JSON with invisible characters (spaces, marks, controls) escaped."""
    out = []
    for ch in json.dumps(value, ensure_ascii=False):
        if visible(ch) or ch in '"\\':
            out.append(ch)
        elif ord(ch) > 0xFFFF:
            v = ord(ch) - 0x10000
            out.append("\\u%04x\\u%04x" % (0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF)))
        else:
            out.append("\\u%04x" % ord(ch))
    return "".join(out)


def main():
    cases = [(c, "create-project", "u1", "", n, want) for c, n, want in NAMES] + EXTRA
    lines = []
    for comment, intent, user_id, project_id, name, normalized in cases:
        case = {"comment": comment, "intent": intent, "user_id": user_id, "project_id": project_id,
                "project_name": name, "normalized": normalized,
                "key": key(intent, user_id, project_id, normalized.encode("utf-8", "surrogatepass").decode("utf-8"))}
        lines.append("    " + dumps(case))
    doc = ('{\n  "comment": "DedupKey vectors; written by clients/testdata/dedupkey.py, do not edit",\n'
           '  "cases": [\n' + ",\n".join(lines) + "\n  ]\n}\n")
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "dedupkey.json"), "w") as f:
        f.write(doc)
    print("%d cases" % len(cases))


if __name__ == "__main__":
    main()
