-- SHA-256 in Lua 5.1 with Redis's bit library, so effectId = H([taskId, revision, node, slot])
-- is computed inside the same script that reads the task's current revision.
-- Checked against hashlib in tests/test_effect_ids.py.

-- Bound on first use, like SHA256_K: a Redis Functions library (ledger.redis_store.
-- library_source) has no `bit` while it loads, only when its functions run.
local band, bor, bxor, bnot, rshift, ror, tobit, tohex

-- Built on first use: the gateway usually sends the effectId (prepare.lua), and a script
-- pays for every table it builds on every run.
local SHA256_K = nil

local function sha256_hex(msg)
  if not SHA256_K then
    band, bor, bxor, bnot = bit.band, bit.bor, bit.bxor, bit.bnot
    rshift, ror, tobit, tohex = bit.rshift, bit.ror, bit.tobit, bit.tohex
    SHA256_K = {
      0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
      0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
      0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
      0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
      0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
      0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
      0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
      0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
    }
  end
  local len = #msg
  local bits = len * 8
  local tail = string.char(
    0, 0, 0, math.floor(bits / 4294967296) % 256,
    math.floor(bits / 16777216) % 256, math.floor(bits / 65536) % 256,
    math.floor(bits / 256) % 256, bits % 256)
  msg = msg .. '\128' .. string.rep('\0', (55 - len) % 64) .. tail
  local h0, h1, h2, h3 = 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a
  local h4, h5, h6, h7 = 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19
  local w = {}
  for chunk = 1, #msg, 64 do
    for i = 0, 15 do
      local p = chunk + i * 4
      local b1, b2, b3, b4 = string.byte(msg, p, p + 3)
      w[i] = tobit(b1 * 16777216 + b2 * 65536 + b3 * 256 + b4)
    end
    for i = 16, 63 do
      local x, y = w[i - 15], w[i - 2]
      local s0 = bxor(ror(x, 7), ror(x, 18), rshift(x, 3))
      local s1 = bxor(ror(y, 17), ror(y, 19), rshift(y, 10))
      w[i] = tobit(w[i - 16] + s0 + w[i - 7] + s1)
    end
    local a, b, c, d, e, f, g, h = h0, h1, h2, h3, h4, h5, h6, h7
    for i = 0, 63 do
      local S1 = bxor(ror(e, 6), ror(e, 11), ror(e, 25))
      local ch = bxor(band(e, f), band(bnot(e), g))
      local t1 = h + S1 + ch + SHA256_K[i + 1] + w[i]
      local S0 = bxor(ror(a, 2), ror(a, 13), ror(a, 22))
      local maj = bxor(band(a, b), band(a, c), band(b, c))
      h, g, f, e = g, f, e, tobit(d + t1)
      d, c, b, a = c, b, a, tobit(t1 + S0 + maj)
    end
    h0, h1, h2, h3 = tobit(h0 + a), tobit(h1 + b), tobit(h2 + c), tobit(h3 + d)
    h4, h5, h6, h7 = tobit(h4 + e), tobit(h5 + f), tobit(h6 + g), tobit(h7 + h)
  end
  return tohex(h0) .. tohex(h1) .. tohex(h2) .. tohex(h3)
      .. tohex(h4) .. tohex(h5) .. tohex(h6) .. tohex(h7)
end

-- effectId exactly as ledger.effects.effect_id computes it. Ids, nodes and slots are
-- restricted to [A-Za-z0-9._:@/-], none of which JSON escapes, so plain concatenation is
-- the compact JSON array json.dumps would produce.
local function effect_id(task_id, revision, node, slot)
  return sha256_hex('["' .. task_id .. '",' .. revision .. ',"' .. node .. '","' .. slot .. '"]')
end
