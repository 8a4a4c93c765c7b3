import json
import os
import unittest

import idemcoord

VECTORS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "testdata", "dedupkey.json")


class DedupKeyTest(unittest.TestCase):
    def test_shared_vectors(self):
        with open(VECTORS, encoding="utf-8") as f:
            cases = json.load(f)["cases"]
        self.assertGreaterEqual(len(cases), 40)
        for c in cases:
            with self.subTest(c["comment"]):
                self.assertEqual(idemcoord.normalize_name(c["project_name"]), c["normalized"])
                self.assertEqual(idemcoord.dedup_key(c["intent"], c["user_id"], c["project_id"], c["project_name"]),
                                 c["key"])

    def test_str_split_is_not_white_space(self):
        # What a hand-written str.split() normalization gets wrong.
        name = "A\u001cB"
        self.assertNotEqual(" ".join(name.lower().split()), "a\u001cb")
        self.assertEqual(idemcoord.normalize_name(name), "a\u001cb")

    def test_missing_values(self):
        self.assertEqual(idemcoord.dedup_key("a", "u", None, None), idemcoord.dedup_key("a", "u", "", ""))
        self.assertEqual(idemcoord.dedup_key("rename", "u1", "prj_7", "x"), "rename:u1:p:prj_7")


if __name__ == "__main__":
    unittest.main()
