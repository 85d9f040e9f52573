"""seeds.py DIR: writes the hand-made inputs of tests/fuzz/corpus, in fuzz_api.c's byte format, so
that a fuzz run starts from calls that reach deep (a forward, then its saved overwritten in one
part, then the backward on it) rather than finding them by chance. make fuzz adds what it finds
under build/fuzz/corpus; inputs worth keeping (one that failed, once fixed) go beside these.

Format (fuzz_api.c, run_input): a, b, c, d (the shape; b's bit 4: FP8), the T byte (max_tokens
= 1 + T % 40), a 4-byte seed, then per call: kind (0 forward, 1 recompute, 2 schedule,
3 and 8 backward, 4 check, 5 schedule_counts, 6 overwrite saved, 7 saved_bytes), slot, flags
(bits 5-7: argument damage; bit 4 and bits 0-1: grad_mode), the tokens byte (below 224:
1 + t % T), the number of routing changes (each: slot byte, kind byte, 4-byte value); a kind 6
call then takes the part of saved, a 4-byte offset in it and the xor byte.
"""
import os
import struct
import sys


def shape(a, b, c, d, t, seed):
    return bytes([a, b, c, d, t]) + struct.pack(">I", seed)


def call(kind, slot, flags, tokens, changes=()):
    out = bytes([kind, slot, flags, tokens, len(changes)])
    for q, which, value in changes:
        out += bytes([q, which]) + struct.pack(">I", value & 0xFFFFFFFF)
    return out


def overwrite(slot, tokens, part, at, xor):
    return call(6, slot, 0, tokens) + bytes([part]) + struct.pack(">I", at) + bytes([xor])


SEEDS = {
    "forward_backward": shape(3, 2, 0, 3, 19, 7) + call(0, 0, 0, 15) + call(3, 0, 0, 15) +
    call(4, 0, 0, 0),
    "shared_f32": shape(2, 1, 3, 0x35, 23, 9) + call(0, 1, 0, 23) + call(3, 1, 1, 23) +
    call(5, 1, 0, 23),
    "stale_saved": shape(1, 1, 1, 0x21, 29, 3) + call(0, 0, 0, 29) + call(0, 1, 0, 10) +
    call(3, 1, 0, 29) + call(3, 0, 0, 10),
    "schedule_then_counts": shape(0, 3, 6, 0x1B, 7, 2) + call(2, 0, 0, 7) + call(5, 0, 0, 7) +
    call(3, 0, 0, 7),
    "bad_id_then_backward": shape(2, 0, 0, 0x27, 11, 4) + call(0, 0, 0, 11, [(5, 1, 77)]) +
    call(3, 0, 0, 11) + call(5, 0, 0, 11),
    "bad_weight_nan": shape(2, 0, 0, 0x27, 11, 4) + call(0, 0, 0, 11, [(5, 0, 0x7FC00000)]) +
    call(3, 0, 0, 11),
    "capacity": shape(0, 0x40, 1, 0x27, 39, 5) + call(0, 0, 0, 39) + call(3, 0, 0, 39) +
    call(5, 0, 0, 39),
    "y_inside_saved": shape(1, 1, 0, 0x23, 9, 6) + call(0, 0, 0x60, 9) + call(0, 0, 0, 9) +
    call(3, 0, 0x60, 9),
    "misaligned_saved": shape(1, 1, 0, 0x23, 9, 6) + call(0, 0, 0x80, 9) + call(3, 0, 0x80, 9),
    "odd_tokens": shape(1, 1, 0, 0x23, 9, 6) + call(0, 0, 0, 224) + call(0, 0, 0, 225) +
    call(7, 0, 0, 226) + call(3, 0, 0, 228),
    "fp8_forward_backward": shape(3, 0x12, 0, 3, 19, 7) + call(0, 0, 0, 15) + call(3, 0, 0, 15) +
    call(3, 0, 1, 15),
    "fp8_shared_counts": shape(2, 0x11, 3, 0x35, 23, 9) + call(0, 1, 0, 23) + call(3, 1, 1, 23) +
    call(5, 1, 0, 23),
    "fp8_buffer_misaligned": shape(2, 0x11, 3, 0x35, 23, 9) + call(0, 1, 0xA0, 23) +
    call(0, 1, 0, 23) + call(3, 1, 0xA0, 23),
    "fp8_corrupt_offsets": shape(2, 0x11, 3, 0x37, 15, 8) + call(0, 1, 0, 15) +
    overwrite(1, 15, 2, 5, 0x40) + call(3, 1, 0, 15),
}
# saved's parts, one each: header, counts, offsets, row_src, row_weight, slot_row,
# mblock_expert, anywhere.
for part in range(8):
    SEEDS[f"corrupt_part{part}"] = (shape(2, 1, 3, 0x37, 15, 8) + call(0, 1, 0, 15) +
                                    overwrite(1, 15, part, 5, 0x40) + call(3, 1, 0, 15) +
                                    call(5, 1, 0, 15))

if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus")
    os.makedirs(out, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print(f"{len(SEEDS)} inputs in {out}")
