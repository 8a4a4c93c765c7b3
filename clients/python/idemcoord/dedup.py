"""The deterministic key, as Go's clients.DedupKey and Node's dedupKey compute it.

The specification is in clients/dedup.go; clients/testdata/dedupkey.json
holds the vectors all three implementations pass.
"""

import hashlib
import re
import unicodedata
from typing import Optional

# Unicode's White_Space property (PropList.txt; unchanged since Unicode 6.3).
# str.split() and re's \s use str.isspace(), a different set: it includes
# U+001C..U+001F.
WHITE_SPACE = ("\t\n\u000b\u000c\r \u0085\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
               "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_WHITE_SPACE_RUNS = re.compile("[%s]+" % re.escape(WHITE_SPACE))
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def normalize_name(name: str) -> str:
    """The normalization dedup_key applies to a project name.

    NFC, every U+FEFF removed, White_Space trimmed, Unicode's full lower-case
    mapping (str.lower: SpecialCasing, Final_Sigma), runs of White_Space
    folded to one space. A lone surrogate is first replaced by U+FFFD.
    """
    s = _LONE_SURROGATE.sub("\ufffd", name or "")
    s = unicodedata.normalize("NFC", s).replace("\ufeff", "").lower()
    return " ".join(w for w in _WHITE_SPACE_RUNS.split(s) if w)


def dedup_key(intent: str, user_id: str, project_id: Optional[str], project_name: str) -> str:
    """The deterministic idempotency key for callers that send none.

    "intent:user_id:p:project_id" when project_id is non-empty, else
    "intent:user_id:n:" and the first 16 hex digits of the SHA-256 of the
    UTF-8 of normalize_name(project_name).
    """
    if project_id:
        return "%s:%s:p:%s" % (intent, user_id, project_id)
    digest = hashlib.sha256(normalize_name(project_name).encode("utf-8")).hexdigest()
    return "%s:%s:n:%s" % (intent, user_id, digest[:16])
