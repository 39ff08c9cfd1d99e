/* A bind() that keeps TCP listeners on one address, for libraries that always bind the wildcard
 * address (Mooncake's handshake and TCP data listeners: see bind.py).
 *
 * Loaded with LD_PRELOAD into tandem's worker processes (Ray starts them with it; bindshim.py
 * builds this file). It does nothing until the process sets TANDEM_BIND_HOST to an IP address:
 * from then on, a bind() of a TCP socket to 0.0.0.0 or :: binds that address instead (the port
 * is kept). An IPv6 wildcard with an IPv4 host becomes the IPv4-mapped ::ffff:a.b.c.d (what a
 * dual-stack socket bound to a.b.c.d listens on); on an IPV6_V6ONLY socket it is left alone.
 * UDP and other sockets, and every bind to a specific address, pass through unchanged.
 *
 * bind.py sets the variable only while a transfer library creates its listeners, and checks the
 * result: a listener still on the wildcard (this file not preloaded) gets the socket filter. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int is_stream(int fd) {
    int type = 0;
    socklen_t len = sizeof type;
    return getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_STREAM;
}

static int is_v6only(int fd) {
    int on = 0;
    socklen_t len = sizeof on;
    return getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &on, &len) == 0 && on;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind)
        real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *host = getenv("TANDEM_BIND_HOST");
    if (!host || !*host || !addr || !is_stream(fd))
        return real_bind(fd, addr, len);

    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in in4;
        memcpy(&in4, addr, sizeof in4);
        if (in4.sin_addr.s_addr == htonl(INADDR_ANY)
            && inet_pton(AF_INET, host, &in4.sin_addr) == 1)
            return real_bind(fd, (const struct sockaddr *)&in4, sizeof in4);
    } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        struct in_addr v4;
        memcpy(&in6, addr, sizeof in6);
        if (IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr)) {
            if (inet_pton(AF_INET6, host, &in6.sin6_addr) == 1)
                return real_bind(fd, (const struct sockaddr *)&in6, sizeof in6);
            if (!is_v6only(fd) && inet_pton(AF_INET, host, &v4) == 1) {
                memset(&in6.sin6_addr, 0, sizeof in6.sin6_addr);
                in6.sin6_addr.s6_addr[10] = 0xff;
                in6.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&in6.sin6_addr.s6_addr[12], &v4, 4);
                return real_bind(fd, (const struct sockaddr *)&in6, sizeof in6);
            }
        }
    }
    return real_bind(fd, addr, len);
}
