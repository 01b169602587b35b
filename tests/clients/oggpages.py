"""Ogg pages written by hand (RFC 3533), for the test clients: the page checksum and one page of
whole packets. Independent of duplex and of the libraries under test."""


def ogg_crc(data):
    crc = 0
    for b in data:
        crc ^= b << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) if crc & 0x80000000 else (crc << 1)
            crc &= 0xFFFFFFFF
    return crc


def ogg_page(packets, serial=1, seq=0, granule=0, flags=0):
    """One Ogg page holding whole `packets`, with a correct checksum."""
    lacing = bytearray()
    for p in packets:
        lacing += bytes([255] * (len(p) // 255) + [len(p) % 255])
    header = bytearray(b"OggS" + bytes([0, flags]) + granule.to_bytes(8, "little")
                       + serial.to_bytes(4, "little") + seq.to_bytes(4, "little")
                       + (0).to_bytes(4, "little") + bytes([len(lacing)]) + lacing)
    page = header + b"".join(packets)
    page[22:26] = ogg_crc(bytes(page)).to_bytes(4, "little")
    return bytes(page)
