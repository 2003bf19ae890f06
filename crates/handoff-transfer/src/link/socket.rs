//! Reads that keep tokio's readiness cache true (both sides of a link).

use tokio::net::TcpStream;

/// One read into `buf`. A read that leaves `buf` short has drained the
/// socket, so it also clears tokio's readiness (as tokio's own `poll_read`
/// does, for the readiness seen before the read): the reader's next wait
/// then goes straight to the I/O driver, without a read that could only say
/// `WouldBlock`. Data that arrives later raises a new readiness event.
pub(super) fn read_once(stream: &TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    read_once_vectored(stream, &mut [std::io::IoSliceMut::new(buf)])
}

/// [`read_once`] into several buffers, filled in order by one `recvmsg`.
pub(super) fn read_once_vectored(
    stream: &TcpStream,
    bufs: &mut [std::io::IoSliceMut<'_>],
) -> std::io::Result<usize> {
    let want: usize = bufs.iter().map(|b| b.len()).sum();
    read_once_with(stream, want, || read_past_readiness(stream, bufs))
}

/// [`read_once`]'s readiness rule around any one read of up to `want`
/// bytes from `stream`.
pub(super) fn read_once_with(
    stream: &TcpStream,
    want: usize,
    mut read: impl FnMut() -> std::io::Result<usize>,
) -> std::io::Result<usize> {
    let mut short = None;
    let r = stream.try_io(tokio::io::Interest::READABLE, || {
        let n = read()?;
        if n > 0 && n < want {
            short = Some(n);
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    });
    match short {
        Some(n) => Ok(n),
        None => r,
    }
}

/// A plain read (`recvmsg(2)`) on the socket, whatever tokio's readiness
/// cache says (it neither consults nor updates it).
pub(super) fn read_past_readiness(
    stream: &TcpStream,
    bufs: &mut [std::io::IoSliceMut<'_>],
) -> std::io::Result<usize> {
    use std::io::Read;
    (&*socket2::SockRef::from(stream)).read_vectored(bufs)
}
