// How many threads a kernel call runs on, on a machine shared with other processes.
//
// Why: each decoder layer's work is split statically among the threads, which meet at six to ten
// barriers per layer (six for one token: isa.h's each_row). When another process holds a core, one
// of our threads waits for it in the run queue while the others spin at the barrier for it: measured
// on 2 cores, plain decoding of a ~0.2B model beside a second specdec process fell to ~1/80 of its
// quiet speed. So in "auto" mode (the default) the kernels run on the cores other processes leave
// free: every ~0.2 s the machine's busy time (/proc/stat) less this process's own (/proc/self/stat)
// gives the cores others used, and the calls until the next sample run on round(cores - others)
// threads, at least 1 and at most the ceiling (torch's threads). Processes at a lower priority than
// this one (niced, such as a background job at nice 19) do not count as others: the scheduler hands
// their cores to this process's threads whenever those are ready (nice 19 against nice 0 gets ~1.5%
// of a contended core), so they leave the cores free. /proc/stat counts niced user time apart ("nice"); it is left
// out unless this process runs niced itself (then the niced are its peers). Counted, they would hold
// auto at 1 thread of 2 beside one busy nice-19 job: it takes the core left idle, which then looks
// used by others at every sample. A fixed count (`--threads N`) is never changed. Results never
// depend on the thread count (cpu.cpp's arithmetic contract), only the speed does.
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>

namespace thread_policy {

constexpr double kSampleSeconds = 0.2;  // the window over which others' CPU time is measured
constexpr double kStaleSeconds = 2.0;   // an older baseline (an idle spell) is restarted, not averaged over

inline std::atomic<int> g_fixed{0};        // > 0: a fixed thread count
inline std::atomic<int> g_chosen{0};       // auto: threads chosen at the last sample (0: none yet)
inline std::atomic<float> g_others{-1.f};  // cores other processes used over the last window (-1: unknown)
inline std::mutex g_sampling;
inline double g_last_wall = 0;
inline long long g_last_busy = 0, g_last_self = 0;

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Whether this process runs niced (nice > 0): then niced processes are its peers, not below it.
inline bool self_niced() {
  errno = 0;
  const int nice = getpriority(PRIO_PROCESS, 0);
  return errno == 0 && nice > 0;
}

// Busy clock ticks of all CPUs since boot: user, system, irq, softirq, steal (not idle, iowait), and
// niced processes' user time where `with_niced`.
inline bool machine_busy(long long& busy, bool with_niced) {
  FILE* f = std::fopen("/proc/stat", "r");
  if (!f) return false;
  long long user, nice, system, idle, iowait, irq, softirq, steal = 0;
  const int n = std::fscanf(f, "cpu %lld %lld %lld %lld %lld %lld %lld %lld", &user, &nice, &system, &idle, &iowait,
                            &irq, &softirq, &steal);
  std::fclose(f);
  busy = user + (with_niced ? nice : 0) + system + irq + softirq + steal;
  return n >= 7;
}

// This process's user + system clock ticks, all its threads.
inline bool own_busy(long long& busy) {
  FILE* f = std::fopen("/proc/self/stat", "r");
  if (!f) return false;
  char buf[1024];
  const size_t len = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[len] = 0;
  const char* p = std::strrchr(buf, ')');  // the command name may hold spaces; fields follow its ')'
  if (!p) return false;
  long long utime, stime;
  // after ')': state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime
  if (std::sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lld %lld", &utime, &stime) != 2) return false;
  busy = utime + stime;
  return true;
}

inline int cores() { return static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN))); }

// Threads for a call in auto mode with at most `ceiling`; samples the machine when the window is due.
inline int automatic(int ceiling) {
  const double now = now_seconds();
  if (now - g_last_wall >= kSampleSeconds && g_sampling.try_lock()) {
    long long busy, self;
    if (machine_busy(busy, self_niced()) && own_busy(self)) {
      const double elapsed = now - g_last_wall;
      if (g_last_wall > 0 && elapsed < kStaleSeconds) {
        const double ticks = elapsed * static_cast<double>(sysconf(_SC_CLK_TCK));
        const double others = std::max(0.0, static_cast<double>(busy - g_last_busy - (self - g_last_self)) / ticks);
        g_others = static_cast<float>(others);
        g_chosen = static_cast<int>(std::lround(std::max(1.0, cores() - others)));
      }
      g_last_wall = now;
      g_last_busy = busy;
      g_last_self = self;
    }
    g_sampling.unlock();
  }
  const int chosen = g_chosen.load();
  return chosen > 0 ? std::min(chosen, ceiling) : ceiling;
}

inline int threads(int ceiling) {
  const int fixed = g_fixed.load();
  return std::max(1, fixed > 0 ? fixed : automatic(ceiling));
}

}  // namespace thread_policy
