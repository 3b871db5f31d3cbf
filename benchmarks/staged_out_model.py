"""A model of the staged-O epilogue's data movement (ffi/cuda/sm90/fwd_epilogue.h, store_staged)
for one consumer warp (d128: two slabs of 64 columns), run on the CPU:
`python3 benchmarks/staged_out_model.py`.

It places each element of the warp's wgmma fragment (lane T, element 4j + 2rr + c = row
T // 4 + 8 rr, column 8 j + 2 (T % 4) + c) where stmatrix.x4 puts it (PTX: matrix i's row r goes
to the address lane 8 i + r gives; its element (r, 2 t + c) comes from lane 4 r + t, register i,
half c), with the epilogue's addresses and register order, then reads back what each lane loads
(chunk L % 8 of rows L // 8 + 4 k) and checks it is the (row, column) the lane stores there. It
also checks that the eight rows of each stmatrix block fall in eight different 16-byte bank
groups (no bank conflict).
"""


def at(row, chunk):  # the epilogue's slab address: 128-byte rows, chunk c of row r at c ^ (r % 8)
    return row * 128 + ((chunk ^ (row & 7)) << 4)


def main():
    for s in range(2):  # slabs: columns 64 s .. 64 s + 63
        smem = {}
        for q in range(4):  # stmatrix.x4 number q of the slab: column groups j, j + 1
            j = s * 8 + 2 * q
            regs = [(j, 0), (j, 1), (j + 1, 0), (j + 1, 1)]  # (group, row half) of registers 0..3
            addr = {}
            for lane in range(32):
                m = lane // 8
                addr[lane] = at(8 * (m % 2) + lane % 8, 2 * q + m // 2)
            for i in range(4):
                for r in range(8):
                    for t in range(4):
                        lane = 4 * r + t
                        group, rr = regs[i]
                        for c in range(2):
                            smem[addr[8 * i + r] + (2 * t + c) * 2] = (lane // 4 + 8 * rr, 8 * group + 2 * (lane % 4) + c)
            for m in range(4):
                groups = {(at(8 * (m % 2) + r, 2 * q + m // 2) // 16) % 8 for r in range(8)}
                assert len(groups) == 8, f"bank conflict: slab {s}, stmatrix {q}, block {m}"
        for lane in range(32):
            chunk = lane % 8
            for k in range(4):
                row = lane // 8 + 4 * k
                got = [smem[at(row, chunk) + 2 * e] for e in range(8)]
                want = [(row, 8 * (s * 8 + chunk) + e) for e in range(8)]
                assert got == want, (s, lane, k, got[:2], want[:2])
    print("every element lands where it is read back; stmatrix rows conflict-free")


if __name__ == "__main__":
    main()
