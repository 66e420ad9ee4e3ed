//! Structured values drawn from fuzz bytes. Past the end of the input every
//! draw is zero, so any prefix of an input is an input, and a mutation
//! changes only the values drawn from the bytes it touched.

/// A reader of structured values over one fuzz input.
#[derive(Debug, Clone)]
pub struct Source<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Source<'a> {
    /// A reader over `data`.
    #[must_use]
    pub fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }

    /// Whether every byte was drawn.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    /// One byte (zero past the end).
    pub fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos = self.pos.saturating_add(1);
        b
    }

    /// A little-endian u16.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    /// A little-endian u32.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// A little-endian u64.
    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// A bool.
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// A value in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        if n <= 256 {
            usize::from(self.u8()) % n
        } else {
            usize::from(self.u16()) % n
        }
    }

    /// One of `items` (`None` when empty).
    pub fn pick<'b, T>(&mut self, items: &'b [T]) -> Option<&'b T> {
        let i = self.below(items.len());
        items.get(i)
    }

    /// A byte string of at most `max` bytes, its length drawn first (one
    /// byte, or two above 255).
    pub fn bytes(&mut self, max: usize) -> &'a [u8] {
        let want = if max < 256 {
            usize::from(self.u8()) % (max + 1)
        } else {
            usize::from(self.u16()) % (max + 1)
        };
        let start = self.pos.min(self.data.len());
        let end = start.saturating_add(want).min(self.data.len());
        self.pos = self.pos.saturating_add(want);
        self.data.get(start..end).unwrap_or(&[])
    }

    /// Every byte not drawn yet.
    pub fn rest(&mut self) -> &'a [u8] {
        let start = self.pos.min(self.data.len());
        self.pos = self.data.len();
        self.data.get(start..).unwrap_or(&[])
    }
}
